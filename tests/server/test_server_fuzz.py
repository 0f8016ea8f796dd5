"""Schema fuzzing (schemathesis) of a real server's OpenAI, vLLM and RL routes, each with its own key (--api-key,
--rl-api-key): no input, valid or not, is a 5xx, and none makes /health wait (probed throughout).

The server is the test's own: the fuzzer changes weight versions, aborts requests and sends chat templates, which
other tests must not see. Each operation gets a bounded number of examples, schema-conforming and schema-violating,
generated from a fixed seed (a CI run is repeatable) and not shrunk (a failure is reported as found, in seconds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from conftest import _serve
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from server_helpers import API_KEY, Server

EXAMPLES_PER_OPERATION = 12
CALL_TIMEOUT_S = 30.0
# Operations that would stop the server answering the fuzzer's next requests: a pause or a sleep holds every
# generation until a resume (tests/server/test_server_pause.py covers them), and init_weight_transfer_engine (and
# prime-rl's /init_broadcaster, tests/server/test_framework_routes.py) waits minutes for a trainer to join its group.
SKIPPED = frozenset(
    {("POST", "/pause"), ("POST", "/sleep"), ("POST", "/init_weight_transfer_engine"), ("POST", "/init_broadcaster")}
)
# Generation work is what the fuzzer's numbers multiply (n=16384 samples is a valid request): n is capped here and the
# context is short, so that the run stays within its time; the limits themselves are tested by
# test_server_robustness.py.
MAX_N = 2
MAX_MODEL_LEN = "96"
RL_KEY = "fuzz-rl-key"
# Issue 28's bound on /health while the fuzzer runs (on CPU).
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def fuzz_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "fuzz.log"
    args = ("--enable-rl-api", "--rl-api-key", RL_KEY, "--trust-request-chat-template")
    yield from _serve(server_model_dir, log, *args, "--max-model-len", MAX_MODEL_LEN, api_key=API_KEY)


def _cheap(body: object) -> None:
    if not isinstance(body, dict):
        return
    # The weight checker's reset zeroes the weights, after which generation is refused (503) until an update: like a
    # pause, it would stop the server answering the fuzzer's next requests (test_server_vllm_routes.py covers it).
    if body.get("action") == "reset":
        body["action"] = "checksum"
    if body.get("method") == "reset_weights":
        body["method"] = "reload_weights"
    for fields in (body, body.get("sampling_params")):  # the OpenAI routes' n, and /inference/v1/generate's
        if isinstance(fields, dict) and type(fields.get("n")) is int and fields["n"] > MAX_N:
            fields["n"] = MAX_N


class _HealthProbe(threading.Thread):
    """GET /health every 50 ms on a connection of its own, keeping the longest wait."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.worst_s = 0.0
        self.probes = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            while not self._stop_event.wait(0.05):
                start = time.perf_counter()
                assert http.get("/health").status_code == 200
                self.worst_s = max(self.worst_s, time.perf_counter() - start)
                self.probes += 1

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


def _fuzz(operation: schemathesis.APIOperation, url: str, headers: dict[str, str]) -> list[str]:
    """The 5xx (and 401) answers to EXAMPLES_PER_OPERATION cases of `operation`, schema-conforming and not."""
    failures: list[str] = []
    modes = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(modes))
    def fuzz(case: schemathesis.Case) -> None:
        _cheap(case.body)
        response = case.call(base_url=url, headers=headers, timeout=CALL_TIMEOUT_S)
        # A 401 would mean the route's key was the wrong one, and the fuzzer reached nothing behind it.
        if response.status_code >= 500 or response.status_code == 401:
            failures.append(f"{response.status_code} {response.text[:300]}\n  {case.as_curl_command()}")

    fuzz()
    return failures


def test_fuzzed_requests_get_no_5xx(fuzz_server: Server) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", timeout=CALL_TIMEOUT_S)
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [op for op in operations if (op.method.upper(), op.path) not in SKIPPED]
    paths = {op.path for op in fuzzed}
    # The RL and vLLM routes are in the document with their bodies, or the fuzzer would not reach them.
    assert {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/collective_rpc"} <= paths
    assert all(op.body for op in fuzzed if op.path in ("/abort_requests", "/weight_checker", "/update_weights"))

    rl_headers = {"Authorization": f"Bearer {RL_KEY}"}
    failures: list[str] = []
    probe = _HealthProbe(fuzz_server.url)
    probe.start()
    for operation in fuzzed:
        headers = rl_headers if "rl" in (operation.tags or ()) else fuzz_server.headers
        failures += _fuzz(operation, fuzz_server.url, headers)
    probe.stop()
    assert not failures, f"{len(failures)} 5xx or 401:\n" + "\n".join(failures[:20])
    assert probe.probes > 10 and probe.worst_s < HEALTH_BOUND_S, f"/health waited {probe.worst_s:.2f} s"
    with fuzz_server.client() as http:
        assert http.get("/health").status_code == 200


def test_a_trusting_server_renders_a_requests_chat_template(fuzz_server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "<{{ messages[0].content }}>"}
    with fuzz_server.client() as http:
        rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200 and rendered.json()["prompt"] == "<hi>"
