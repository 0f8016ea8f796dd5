"""Real `rlserve serve` processes on 127.0.0.1 for the server tests, and helpers to read their SSE streams.

Server starts cost seconds, so each is started once per session: `server` (RL API on, API key, the `nccl`
weight-transfer backend for the live-update test) and, only for the tests that need them, `plain_server` (RL API
off), `batch_invariant_server`, `lora_server`, `replica_servers`, `extension_server` and `reasoning_server` (a
scripted model's thinking and tool call, parsed). Every test that pauses resumes in `rl`'s teardown, so a failing test
cannot leave the shared server paused.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import API_KEY, HTTP_TIMEOUT_S, MODEL_NAME, Server, free_port, launch

from rlserve.rl.client import RLServeClient
from rlserve.server.serve_flags import DEV_MODE_ENV
from rlserve.toy import make_lora_dir, make_model_dir, make_scripted_model_dir, merge_lora

TESTS_DIR = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0  # a loaded CI machine needs tens of seconds to import torch and build the engine
STOP_TIMEOUT_S = 15.0


def _start(model_dir: Path, log: Path, *args: str, api_key: str | None, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", str(model_dir), "--port", str(port)]
    cmd += ["--served-model-name", MODEL_NAME, "--log-level", "warning", *args]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    unset = ("RLSERVE_API_KEY", "RLSERVE_RL_API_KEY")
    environment = {**{k: v for k, v in os.environ.items() if k not in unset}, **(env or {})}
    # tests/ on the path: a server may load tests/worker_extension.py (--worker-extension-cls).
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), environment.get("PYTHONPATH")]))
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    again = log.with_name(f"{log.stem}-again{log.suffix}")
    relaunch = functools.partial(_start, model_dir, again, *args, api_key=api_key, env=env)
    return Server(f"http://127.0.0.1:{port}", proc, log, headers, relaunch)


PORT_RETRIES = 3  # starts on a new port when another process took the one free_port gave


def _wait_healthy(server: Server) -> None:
    """Until /health answers 200; a server whose port was taken before it bound it (free_port's port is free only
    when asked) is started again on another, up to PORT_RETRIES times."""
    deadline = time.monotonic() + START_TIMEOUT_S
    retries = PORT_RETRIES
    # One client for every poll: httpx.get makes a client (and its TLS context, ~20 ms of CPU) per call, which
    # competed with the starting server for the cores.
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                if retries and server.relaunch is not None and "Address already in use" in server.log_tail():
                    retries -= 1
                    server.take_over(server.relaunch())
                    continue
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
            try:
                if http.get(server.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"server not healthy after {START_TIMEOUT_S:g} s:\n{server.log_tail()}")


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(STOP_TIMEOUT_S)


def _serve(
    model_dir: Path, log: Path, *args: str, api_key: str | None, env: dict[str, str] | None = None
) -> Iterator[Server]:
    server = _start(model_dir, log, *args, api_key=api_key, env=env)
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # initializer_range 0.2: peaked next-token distributions, so greedy outputs are clear of float noise.
    return make_model_dir(tmp_path_factory.mktemp("server-model") / "toy", initializer_range=0.2)


@pytest.fixture(scope="session")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "server.log"
    wt = json.dumps({"backend": "nccl"})
    yield from _serve(server_model_dir, log, "--enable-rl-api", "--weight-transfer-config", wt, api_key=API_KEY)


@pytest.fixture(scope="session")
def batch_invariant_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "batch-invariant.log"
    args = ("--batch-invariant", "--logprobs-mode", "processed_logprobs")
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY)


@pytest.fixture(scope="session")
def replica_servers(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    """Two more RL-enabled servers on the same checkpoint: data-parallel replicas, started side by side."""
    logs = tmp_path_factory.mktemp("server-logs")
    wt = json.dumps({"backend": "nccl"})
    args = ("--enable-rl-api", "--weight-transfer-config", wt)
    servers = [_start(server_model_dir, logs / f"replica-{i}.log", *args, api_key=API_KEY) for i in range(2)]
    try:
        for server in servers:
            _wait_healthy(server)
        yield servers
    finally:
        for server in servers:
            _stop(server)


@pytest.fixture(scope="session")
def extension_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "extension.log"
    args = ("--enable-rl-api", "--worker-extension-cls", "worker_extension:CheckpointLoader")
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY)


# What `reasoning_server`'s model writes after any prompt that ends with a newline (as every generation prompt does):
# thinking, its end spelled in byte tokens (streamed one character a chunk), an answer and a tool call.
REASONING = "Go"
ANSWER = " Yes\t"
TOOL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCRIPT = ["\n", *REASONING, *"</think>", *ANSWER, "<tool_call>", TOOL_CALL, "</tool_call>"]
SCRIPT_TEXT = "".join(SCRIPT[1:])
# Qwen3's switches in ChatML: enable_thinking false closes an empty thinking block in the generation prompt, an
# assistant turn's reasoning_content renders as its thinking, and reasoning_effort shows in a system turn.
REASONING_TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\neffort: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`--reasoning-parser qwen3` with hermes tool calls, over a model that writes SCRIPT."""
    added = ["<tool_call>", TOOL_CALL, "</tool_call>"]
    model_dir = make_scripted_model_dir(tmp_path_factory.mktemp("scripted-model") / "toy", SCRIPT, added)
    log = tmp_path_factory.mktemp("server-logs") / "reasoning.log"
    args = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield from _serve(model_dir, log, *args, "--chat-template", REASONING_TEMPLATE, api_key=API_KEY)


@pytest.fixture(scope="session")
def server_lora_dirs(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters of the server's checkpoint ("static", "fresh", "fresh-v2": fresh after an optimizer step) and the
    checkpoint with "static" merged in ("static-merged"): what the server must compute under that adapter."""
    root = tmp_path_factory.mktemp("server-lora")
    dirs = {
        name: make_lora_dir(root / name, server_model_dir, rank=8, seed=seed)
        for seed, name in enumerate(("static", "fresh", "fresh-v2"), start=1)
    }
    dirs["static-merged"] = merge_lora(root / "static-merged", server_model_dir, dirs["static"])
    return dirs


@pytest.fixture(scope="session")
def lora_server(server_lora_dirs: dict[str, Path], server_model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    """Two adapter slots, "static" loaded at start (--lora-modules); the tests load and unload others, from the
    adapters' directory (--allowed-weight-dirs), with runtime updating on as vLLM's variable turns it on."""
    log = tmp_path_factory.mktemp("server-logs") / "lora.log"
    args = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    args += ("--lora-modules", f"static={server_lora_dirs['static']}")
    args += ("--allowed-weight-dirs", str(server_lora_dirs["static"].parent))
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})


@pytest.fixture(scope="session")
def dev_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """As SkyRL and TRL users start vLLM for their clients: dev mode (VLLM_SERVER_DEV_MODE=1), no API key (neither
    client sends one), `--weight-transfer-config '{"backend": "nccl"}'` (gloo on the CPU). Each test that pushes
    weights pushes a checkpoint of its own seed, one the server has not had."""
    args = (str(server_model_dir), "--served-model-name", MODEL_NAME, "--dtype", "float32")
    args += ("--weight-transfer-config", '{"backend": "nccl"}')
    server = launch(tmp_path_factory.mktemp("dev-server"), *args, env={DEV_MODE_ENV: "1"})
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


@pytest.fixture(scope="session")
def plain_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "plain.log"
    yield from _serve(server_model_dir, log, api_key=None)


def rl_client(server: Server) -> Iterator[RLServeClient]:
    """An RL client of `server` for one test; the server is shared, so it is left resumed."""
    client = RLServeClient(server.url, api_key=API_KEY, timeout=HTTP_TIMEOUT_S)
    try:
        yield client
    finally:
        client.resume()
        client.close()


@pytest.fixture
def rl(server: Server) -> Iterator[RLServeClient]:
    yield from rl_client(server)


@pytest.fixture
def start_server(server_model_dir: Path, tmp_path: Path) -> Iterator:
    """start_server(*args) -> a healthy server of its own (for tests that kill parts of it); stopped at teardown."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        server = _start(server_model_dir, tmp_path / f"server-{len(started)}.log", *args, api_key=API_KEY)
        started.append(server)
        _wait_healthy(server)
        return server

    yield start
    for server in started:
        _stop(server)
