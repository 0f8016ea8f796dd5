"""Trainer-side helpers: typed HTTP clients for a server started with `rlserve serve --enable-rl-api`."""

from rlserve.rl.client import AsyncRLServeClient, AsyncRLServeGroup, RLServeClient, RLServeError

__all__ = ["AsyncRLServeClient", "AsyncRLServeGroup", "RLServeClient", "RLServeError"]
