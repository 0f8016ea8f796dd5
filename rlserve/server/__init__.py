"""HTTP serving: the OpenAI-compatible API and vLLM's RL control routes (`rlserve serve MODEL`)."""

from rlserve.server.app import build_app

__all__ = ["build_app"]
