"""The engines behind a vllm-router, driven as one: the router forwards the data plane (completions, chat, generate)
only, so a trainer's control calls (pause, weight updates, resume) must reach each engine itself.

    async with await group_behind_router("http://router:30000", api_key="KEY") as engines:
        await engines.pause(mode="keep")
        ...  # a weight update, as with AsyncRLServeGroup
        await engines.resume()

The engines are the router's workers, read from its `GET /list_workers` (`{"urls": [...]}`).
"""

from __future__ import annotations

import httpx

from rlserve.rl.client import DEFAULT_TIMEOUT_S, AsyncRLServeGroup


async def engine_urls_behind(router_url: str, timeout: float = 10.0) -> list[str]:
    """The worker URLs the router sends requests to."""
    async with httpx.AsyncClient(base_url=router_url, timeout=timeout) as http:
        response = await http.get("/list_workers")
    response.raise_for_status()
    urls = response.json().get("urls")
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise ValueError(f"router_url: {router_url}/list_workers did not list worker URLs: {response.text[:200]}")
    return urls


async def group_behind_router(
    router_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
) -> AsyncRLServeGroup:
    """An AsyncRLServeGroup of every engine behind the router (ValueError if it has none)."""
    urls = await engine_urls_behind(router_url)
    if not urls:
        raise ValueError(f"router_url: the router at {router_url} has no workers")
    return AsyncRLServeGroup(urls, api_key=api_key, timeout=timeout)
