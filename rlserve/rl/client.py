"""Typed clients for the trainer side of `rlserve serve --enable-rl-api`: control over HTTP (httpx), sync and async.

Weight bytes do not travel here; they go over the weight-transfer backend. The usual round, with the NCCL backend:

    client = RLServeClient("http://127.0.0.1:8000", api_key="KEY")
    init_info = {"master_address": host, "master_port": port, "rank_offset": 1, "world_size": 2}
    # The server's init blocks until the trainer joins the group, and trainer_init blocks until the server does:
    # run the HTTP call on a thread while joining.
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, init_info)
        group = NCCLWeightTransferEngine.trainer_init(init_info)
        joined.result()
    client.pause(mode="keep")
    client.start_weight_update()
    with ThreadPoolExecutor(1) as pool:  # update_weights returns once the broadcast has been received
        done = pool.submit(client.update_weights, {"names": ..., "dtype_names": ..., "shapes": ...})
        NCCLWeightTransferEngine.trainer_send_weights(params, NCCLTrainerSendWeightsArgs(group=group))
        done.result()
    client.finish_weight_update(weight_version="step-1")
    client.resume()

Every failure (HTTP error status) raises `RLServeError` with the status and the server's JSON error body. A call
that may be repeated without harm (pause, resume, the status reads, aborts) is sent again after a transport error (a
kept-alive connection the server closed, a reset under load), up to `RETRY_DELAYS_S`; a weight transfer never is.
`AsyncRLServeGroup` drives several servers (data-parallel replicas) as one, with one broadcast updating them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

DEFAULT_TIMEOUT_S = 600.0  # weight transfers and rendezvous may legitimately take minutes
RETRY_DELAYS_S = (0.1, 0.5, 2.0)  # before each new attempt of an idempotent call whose connection failed

T = TypeVar("T")


class RLServeError(Exception):
    """The server answered with an error status. `body` is its JSON (`{"error": {message, type, param, code}}`)."""

    def __init__(self, status_code: int, body: Any, method: str, path: str) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else body
        super().__init__(f"{method} {path} -> {status_code}: {message}")
        self.status_code = status_code
        self.body = body

    @property
    def param(self) -> str | None:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        return error.get("param") if isinstance(error, dict) else None


@dataclass(frozen=True)
class _Call:
    """One route call, built once (in `_Routes`) and sent by either client; `key` picks the result's field."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    key: str | None = None
    idempotent: bool = False  # sending it twice does what sending it once does: safe to retry

    def retry_delays(self) -> tuple[float | None, ...]:
        """The wait before each further attempt after a transport error; None: raise it."""
        return (*RETRY_DELAYS_S, None) if self.idempotent else (None,)


class _Routes:
    """Every route once, as a call builder (or a fixed call), shared by both clients."""

    @staticmethod
    def pause(mode: str, clear_cache: bool) -> _Call:
        # A pause repeated while paused is answered at once (the engine is already paused), so a retry is safe.
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        return _Call("POST", "/pause", params=params, idempotent=True)

    resume = _Call("POST", "/resume", idempotent=True)
    is_paused = _Call("GET", "/is_paused", key="is_paused", idempotent=True)

    @staticmethod
    def init_weight_transfer_engine(init_info: dict[str, Any]) -> _Call:
        return _Call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    start_weight_update = _Call("POST", "/start_weight_update", json={"is_checkpoint_format": True})
    shutdown_weight_transfer_engine = _Call("POST", "/shutdown_weight_transfer_engine")

    @staticmethod
    def update_weights(update_info: dict[str, Any]) -> _Call:
        return _Call("POST", "/update_weights", json={"update_info": update_info})

    @staticmethod
    def finish_weight_update(weight_version: str | None) -> _Call:
        body = {} if weight_version is None else {"weight_version": weight_version}
        return _Call("POST", "/finish_weight_update", json=body)

    @staticmethod
    def update_weight_version(new_version: str) -> _Call:
        return _Call("POST", "/update_weight_version", json={"new_version": new_version})

    get_weight_version = _Call("GET", "/weight_version", key="weight_version", idempotent=True)
    get_world_size = _Call("GET", "/get_world_size", key="world_size", idempotent=True)
    weight_checksums = _Call("POST", "/weight_checker", json={"action": "checksum"}, key="checksums", idempotent=True)

    @staticmethod
    def abort_requests(request_ids: list[str] | None) -> _Call:
        body = {} if request_ids is None else {"request_ids": request_ids}
        return _Call("POST", "/abort_requests", json=body, key="aborted", idempotent=True)

    reset_prefix_cache = _Call("POST", "/reset_prefix_cache", idempotent=True)

    @staticmethod
    def sleep(level: int, mode: str) -> _Call:
        return _Call("POST", "/sleep", params={"level": level, "mode": mode})

    @staticmethod
    def wake_up(tags: list[str] | None) -> _Call:
        return _Call("POST", "/wake_up", params={} if tags is None else {"tags": tags})

    is_sleeping = _Call("GET", "/is_sleeping", key="is_sleeping", idempotent=True)


def _result(call: _Call, response: httpx.Response) -> Any:
    try:
        body = response.json() if response.content else None
    except ValueError:
        body = response.text
    if response.is_error:
        raise RLServeError(response.status_code, body, call.method, call.path)
    return body[call.key] if call.key else body


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class RLServeClient:
    """Blocking client. Safe to share between threads (httpx.Client is)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout)

    def _send(self, call: _Call) -> Any:
        for delay in call.retry_delays():
            try:
                return _result(call, self._http.request(call.method, call.path, params=call.params, json=call.json))
            except httpx.TransportError:
                if delay is None:
                    raise
                time.sleep(delay)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RLServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_healthy(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        """Poll /health until it answers 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._http.get("/health", timeout=max(interval, 1.0)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._http.base_url} did not become healthy within {timeout:g} s")
            time.sleep(interval)

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Returns once the pause holds: for "abort" and "wait", once the affected requests have ended."""
        self._send(_Routes.pause(mode, clear_cache))

    def resume(self) -> None:
        self._send(_Routes.resume)

    def is_paused(self) -> bool:
        return self._send(_Routes.is_paused)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Blocks until the trainer has joined the transfer group: call it on a thread while calling trainer_init."""
        self._send(_Routes.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._send(_Routes.start_weight_update)

    def shutdown_weight_transfer_engine(self) -> None:
        self._send(_Routes.shutdown_weight_transfer_engine)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Blocks until the engine has received and loaded the tensors: run it beside trainer_send_weights."""
        self._send(_Routes.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._send(_Routes.finish_weight_update(weight_version))

    def update_weight_version(self, new_version: str) -> None:
        self._send(_Routes.update_weight_version(new_version))

    def get_weight_version(self) -> str:
        return self._send(_Routes.get_weight_version)

    def get_world_size(self) -> int:
        return self._send(_Routes.get_world_size)

    def weight_checksums(self) -> dict[str, str]:
        return self._send(_Routes.weight_checksums)

    def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort the server's requests (all, or those with these response ids); returns how many it found."""
        return self._send(_Routes.abort_requests(request_ids))

    def reset_prefix_cache(self) -> None:
        self._send(_Routes.reset_prefix_cache)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the engine's device memory (level 1: weights to host memory, KV dropped; 2: both dropped); mode
        "abort" (vLLM's default) ends the requests in flight first, "keep" freezes them until wake_up."""
        self._send(_Routes.sleep(level, mode))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back "weights", "kv_cache", "scheduling" (default: all)."""
        self._send(_Routes.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self._send(_Routes.is_sleeping)


class AsyncRLServeClient:
    """The same calls as RLServeClient, awaitable (httpx.AsyncClient). init_weight_transfer_engine and
    update_weights complete only together with the trainer's trainer_init / trainer_send_weights, which block: run
    those in a thread (asyncio.to_thread) while awaiting these."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout)

    async def _send(self, call: _Call) -> Any:
        for delay in call.retry_delays():
            try:
                response = await self._http.request(call.method, call.path, params=call.params, json=call.json)
                return _result(call, response)
            except httpx.TransportError:
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRLServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def wait_healthy(self, timeout: float = 120.0, interval: float = 0.25) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (await self._http.get("/health", timeout=max(interval, 1.0))).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self._http.base_url} did not become healthy within {timeout:g} s")
            await asyncio.sleep(interval)

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._send(_Routes.pause(mode, clear_cache))

    async def resume(self) -> None:
        await self._send(_Routes.resume)

    async def is_paused(self) -> bool:
        return await self._send(_Routes.is_paused)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self._send(_Routes.init_weight_transfer_engine(init_info))

    async def start_weight_update(self) -> None:
        await self._send(_Routes.start_weight_update)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._send(_Routes.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._send(_Routes.finish_weight_update(weight_version))

    async def update_weight_version(self, new_version: str) -> None:
        await self._send(_Routes.update_weight_version(new_version))

    async def get_weight_version(self) -> str:
        return await self._send(_Routes.get_weight_version)

    async def get_world_size(self) -> int:
        return await self._send(_Routes.get_world_size)

    async def weight_checksums(self) -> dict[str, str]:
        return await self._send(_Routes.weight_checksums)

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        return await self._send(_Routes.abort_requests(request_ids))

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self._send(_Routes.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._send(_Routes.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._send(_Routes.is_sleeping)

    async def reset_prefix_cache(self) -> None:
        await self._send(_Routes.reset_prefix_cache)


class AsyncRLServeGroup:
    """Several `rlserve serve` replicas driven as one (data-parallel inference, as PipelineRL runs its servers): every
    control call goes to all replicas at once and returns when all have answered (the first error raises). The
    replicas join one weight-transfer group behind the trainer's rank 0, so one broadcast updates all of them:

        group = AsyncRLServeGroup(urls, api_key="KEY")
        init_infos = await group.init_infos(host, port)  # rank offsets from each replica's world size
        _, nccl_group = await asyncio.gather(
            group.init_weight_transfer_engine(init_infos),
            asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, init_infos[0]),  # the trainer is rank 0
        )
        await group.pause(mode="keep"); await group.start_weight_update()
        await asyncio.gather(group.update_weights(update_info), asyncio.to_thread(trainer_send_weights, ...))
        await group.finish_weight_update("step-1"); await group.resume()
    """

    def __init__(
        self, base_urls: Sequence[str], api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        if not base_urls:
            raise ValueError("base_urls: expected at least one server URL")
        self.clients = [AsyncRLServeClient(url, api_key=api_key, timeout=timeout) for url in base_urls]

    async def _all(self, call: Callable[[AsyncRLServeClient], Awaitable[T]]) -> list[T]:
        return list(await asyncio.gather(*(call(client) for client in self.clients)))

    async def aclose(self) -> None:
        await self._all(lambda c: c.aclose())

    async def __aenter__(self) -> AsyncRLServeGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def wait_healthy(self, timeout: float = 120.0) -> None:
        await self._all(lambda c: c.wait_healthy(timeout))

    async def init_infos(self, master_address: str, master_port: int) -> list[dict[str, Any]]:
        """One init_info per replica, in order: replica i's workers take the ranks after replica i-1's."""
        sizes = await self._all(lambda c: c.get_world_size())
        world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        return [
            {"master_address": master_address, "master_port": master_port, "rank_offset": o, "world_size": world_size}
            for o in offsets
        ]

    async def init_weight_transfer_engine(self, init_infos: Sequence[dict[str, Any]]) -> None:
        if len(init_infos) != len(self.clients):
            raise ValueError(f"init_infos: expected one per replica ({len(self.clients)}), got {len(init_infos)}")
        await asyncio.gather(*(c.init_weight_transfer_engine(i) for c, i in zip(self.clients, init_infos, strict=True)))

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        await self._all(lambda c: c.pause(mode, clear_cache))

    async def resume(self) -> None:
        await self._all(lambda c: c.resume())

    async def start_weight_update(self) -> None:
        await self._all(lambda c: c.start_weight_update())

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._all(lambda c: c.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._all(lambda c: c.finish_weight_update(weight_version))

    async def get_weight_versions(self) -> list[str]:
        return await self._all(lambda c: c.get_weight_version())

    async def weight_checksums(self) -> list[dict[str, str]]:
        return await self._all(lambda c: c.weight_checksums())
