"""Constants and helpers shared by the server tests: the server handle and a parser for SSE streams."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from rlserve.engine.wire.process import free_port

API_KEY = "test-key"
MODEL_NAME = "toy"
HTTP_TIMEOUT_S = 60.0
BLOCK_SIZE = 16  # the engine's default block size: prefix-cache hits come in multiples of it


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path
    headers: dict[str, str] = field(default_factory=dict)
    # The same command on a new port: the port came from free_port, and another process may bind it before the
    # server does (conftest._wait_healthy starts it again then).
    relaunch: Callable[[], Server] | None = None

    def take_over(self, other: Server) -> None:
        """Become `other` (its relaunch of this server), so that whoever holds this handle reaches the new one."""
        self.url, self.proc, self.log, self.relaunch = other.url, other.proc, other.log, other.relaunch

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT_S, **kwargs)

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=HTTP_TIMEOUT_S, **kwargs)

    def openai(self) -> openai.OpenAI:
        """The `openai` package's client of this server, with its key (no retries: a test sees every failure)."""
        key = self.headers.get("Authorization", "").removeprefix("Bearer ") or "EMPTY"
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, timeout=HTTP_TIMEOUT_S, max_retries=0)


@dataclass
class Choice:
    """What one choice of a stream delivered."""

    text: str = ""
    num_tokens: int = 0  # counted from token_weight_versions: one entry per token, in every chunk that has tokens
    token_ids: list[int] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    num_chunks: int = 0


@dataclass
class Stream:
    """A parsed SSE response: chunks by choice, the usage chunk, and how many [DONE] markers came."""

    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict | None = None
    done_markers: int = 0
    errors: list[dict] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each token-carrying chunk
    finished_at: float | None = None  # when the first finish_reason arrived

    def add(self, payload: str) -> None:
        if payload == "[DONE]":
            self.done_markers += 1
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk["choices"]:
            choice = self.choices.setdefault(c["index"], Choice())
            choice.num_chunks += 1
            choice.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
            versions = c.get("token_weight_versions") or []
            choice.weight_versions += versions
            choice.num_tokens += len(versions)
            choice.token_ids += c.get("token_ids") or []
            if versions:
                self.chunk_times.append(time.monotonic())
            if c.get("finish_reason") is not None:
                choice.finish_reasons.append(c["finish_reason"])
                if self.finished_at is None:
                    self.finished_at = time.monotonic()

    @property
    def only(self) -> Choice:
        assert list(self.choices) == [0], self.choices
        return self.choices[0]

    @property
    def tokens_so_far(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())


async def read_stream(
    client: httpx.AsyncClient, path: str, body: dict, into: Stream | None = None, headers: dict | None = None
) -> Stream:
    """POST a streaming request and parse every SSE event; `into` lets a caller watch the stream as it grows. The
    request asks for each token's weight version, which counts the tokens of every chunk."""
    stream = into if into is not None else Stream()
    body = {**body, "stream": True, "return_token_weight_versions": True}
    async with client.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                stream.add(line[len("data: ") :])
    return stream


def launch(
    tmp_path: Path, *argv: str, env: dict[str, str] | None = None, headers: dict[str, str] | None = None
) -> Server:
    """A real `rlserve serve` with this command line on 127.0.0.1 (the caller waits for it with
    conftest._wait_healthy and stops it with conftest._stop)."""
    port = free_port()
    cmd = [sys.executable, "-m", "rlserve.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port)]
    # Neither a key nor vLLM dev mode from the environment: the command line says what the test means.
    unset = ("RLSERVE_API_KEY", "RLSERVE_RL_API_KEY", "VLLM_SERVER_DEV_MODE")
    environment = {k: v for k, v in os.environ.items() if k not in unset}
    log = tmp_path / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**environment, **(env or {})})
    relaunch = functools.partial(launch, tmp_path, *argv, env=env, headers=headers)
    return Server(f"http://127.0.0.1:{port}", proc, log, headers or {}, relaunch)
