"""Requests, their KV-cache blocks and the scheduler: what runs in each step, handed to the worker as a batch."""
