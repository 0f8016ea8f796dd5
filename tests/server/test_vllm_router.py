"""Two `rlserve serve` engines behind the real vllm-router (the `vllm-router` package, 0.1.17, a Rust binary in a
wheel), as SkyRL a9564572 deploys them (`inference_servers/utils.py` `build_router_args`: policy `consistent_hash`;
its client sends `X-Session-ID`): requests spread over both, a session sticks to one, the cache-aware policy sends a
repeated prompt where its prefix is cached, and `rlserve.rl.router` reaches both engines with the control calls the
router does not forward."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file
from server_helpers import API_KEY, HTTP_TIMEOUT_S, MODEL_NAME, Server, free_port

from rlserve.dtypes import dtype_name
from rlserve.rl.router import engine_urls_behind, group_behind_router
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    compare_checksums,
    weight_checksums,
)

pytest.importorskip("vllm_router")
pytestmark = pytest.mark.slow  # two routers over two engines: ~30 s on a loaded machine

ROUTER_START_TIMEOUT_S = 60.0


def _router_command() -> list[str]:
    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    return [binary]


@contextmanager
def _router(engines: list[Server], policy: str, log: Path) -> Iterator[str]:
    port = free_port()
    cmd = [*_router_command(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *(s.url for s in engines), "--prometheus-port", str(free_port())]
    cmd += ["--log-level", "warning", "--disable-retries"]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        with httpx.Client(timeout=2.0) as http:  # one client for every poll (httpx.get makes one per call)
            while True:
                assert proc.poll() is None, f"vllm-router exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                try:
                    if http.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"vllm-router not up:\n{log.read_text()[-3000:]}"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _finished_requests(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def _served_by(engines: list[Server], send: Callable[[], httpx.Response]) -> int:
    """The index of the engine that served one request (the one whose finished-request count went up)."""
    before = [_finished_requests(s) for s in engines]
    response = send()
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10.0
    while True:  # the count may land just after the response
        grew = [i for i, s in enumerate(engines) if _finished_requests(s) > before[i]]
        if grew:
            assert len(grew) == 1, grew
            return grew[0]
        assert time.monotonic() < deadline, "no engine counted the request"
        time.sleep(0.05)


def _completion(router: str, prompt: str, headers: dict[str, str] | None = None) -> Callable[[], httpx.Response]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    auth = {"Authorization": f"Bearer {API_KEY}", **(headers or {})}
    return lambda: httpx.post(router + "/v1/completions", json=body, headers=auth, timeout=HTTP_TIMEOUT_S)


def test_consistent_hash_spreads_sessions_and_each_sticks(replica_servers: list[Server], tmp_path: Path) -> None:
    with _router(replica_servers, "consistent_hash", tmp_path / "router.log") as router:
        owners: dict[str, set[int]] = {}
        for i in range(16):
            session = f"rollout-{i}"
            for turn in range(2):  # a multi-turn rollout: each turn must find its KV cache
                send = _completion(router, f"turn {turn} of {session}", {"X-Session-ID": session})
                owners.setdefault(session, set()).add(_served_by(replica_servers, send))
        chat = httpx.post(
            router + "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=HTTP_TIMEOUT_S,
        )
    assert all(len(engines) == 1 for engines in owners.values()), owners
    assert set().union(*owners.values()) == {0, 1}, owners
    assert chat.status_code == 200, chat.text  # the router adds SGLang's fields to chat bodies too


def test_cache_aware_sends_a_cached_prefix_to_its_engine(replica_servers: list[Server], tmp_path: Path) -> None:
    """With one engine busy (its requests held by a keep-pause), an unrelated prompt goes to the idle engine, while a
    prompt whose prefix the busy engine has cached still goes to the busy one."""
    cached, unrelated = (" ".join(f"{word}{i}" for i in range(40)) for word in ("alpha", "omega"))
    with _router(replica_servers, "cache_aware", tmp_path / "router.log") as router:
        owner = _served_by(replica_servers, _completion(router, cached))
        busy = replica_servers[owner]
        with busy.client() as admin, ThreadPoolExecutor(2) as pool:
            admin.post("/pause", params={"mode": "keep", "clear_cache": "false"}).raise_for_status()
            try:
                held = [pool.submit(_completion(router, cached + " held"))]
                _wait_for_load(busy, 1)
                elsewhere = _served_by(replica_servers, _completion(router, unrelated))
                held.append(pool.submit(_completion(router, cached + " again")))
                _wait_for_load(busy, 2)  # routed to the busy engine, for its cache
            finally:
                admin.post("/resume").raise_for_status()
            assert [f.result(timeout=HTTP_TIMEOUT_S).status_code for f in held] == [200, 200]
    assert elsewhere != owner


def _wait_for_load(server: Server, requests: int) -> None:
    deadline = time.monotonic() + 10.0
    while httpx.get(server.url + "/load", timeout=HTTP_TIMEOUT_S).json()["server_load"] < requests:
        assert time.monotonic() < deadline, f"fewer than {requests} requests reached {server.url}"
        time.sleep(0.05)


def test_router_helper_updates_every_engine(replica_servers: list[Server], tmp_path: Path) -> None:
    new = load_file(make_model_dir(tmp_path / "new", seed=21, initializer_range=0.2) / "model.safetensors")
    names = sorted(new)
    update_info = {
        "names": names,
        "dtype_names": [dtype_name(new[n].dtype) for n in names],
        "shapes": [list(new[n].shape) for n in names],
    }

    async def update(router: str) -> tuple[list[str], list[str], list[dict[str, str]]]:
        urls = await engine_urls_behind(router)
        async with await group_behind_router(router, api_key=API_KEY, timeout=60) as engines:
            infos = await engines.init_infos("127.0.0.1", free_port())
            _, nccl_group = await asyncio.gather(
                engines.init_weight_transfer_engine(infos),
                asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**infos[0], "timeout_s": 60}),
            )
            await engines.pause(mode="keep")
            await engines.start_weight_update()
            args = NCCLTrainerSendWeightsArgs(group=nccl_group)
            await asyncio.gather(
                engines.update_weights(update_info),
                asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights, ((n, new[n]) for n in names), args),
            )
            await engines.finish_weight_update("via-router")
            await engines.resume()
            nccl_group.shutdown()
            return urls, await engines.get_weight_versions(), await engines.weight_checksums()

    with _router(replica_servers, "consistent_hash", tmp_path / "router.log") as router:
        urls, versions, checksums = asyncio.run(update(router))
        served = _completion(router, "after the update")()
    assert sorted(urls) == sorted(s.url for s in replica_servers)
    assert versions == ["via-router", "via-router"]
    assert all(compare_checksums(weight_checksums(new.items()), c)["match"] for c in checksums)
    assert served.status_code == 200, served.text
