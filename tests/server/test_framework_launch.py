"""Each RL framework's own launch command line (framework_launch_lines.py: built as its launcher code builds it, at the
commit or release named there) starts `rlserve serve` on a tiny model; the server answers the framework's kind of
request and its flags take effect. The servers start side by side (one module fixture).

What differs from the framework's line, and why (nothing else is changed; the test adds `--host 127.0.0.1 --port P`
at the end, which wins over a `--host` / `--port` the line has, as argparse takes the last):
- the model: a tiny random checkpoint whose context (16,384 positions) holds PipelineRL's `--max_model_len 10000`;
- SkyRL and verl: without `--worker-extension-cls` (verl's extension imports vLLM's worker internals; SkyRL's runs
  under the vllm import surface in test_skyrl_worker_extension.py, loaded past skyrl's package `__init__`s, which
  pydantic refuses on Python 3.11; see docs/frameworks.md); verl: `--load_format auto` instead of `dummy` (the answer
  is then the checkpoint's, not random weights) and `--dtype float32` (its bfloat16 on the CPU is slow);
- PipelineRL: its debug mode's line (`--disable-weight-updates`); the line that joins the trainer's group at start is
  test_framework_routes.py's `pipelinerl` fixture.
prime-rl's line serves its routes in test_framework_routes.py (`prime_server`: its line, plus the RL API and a key,
which its control routes need on rlserve). TRL's `trl vllm-serve` (its launcher execs `vllm serve` with its line) runs
in test_trl_vllm_serve.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import _stop, _wait_healthy
from framework_launch_lines import pipelinerl_flags, skyrl_flags, verl_flags
from server_helpers import Server, launch

from rlserve.toy import make_model_dir

CONTEXT = 16384  # the tiny model's max_position_embeddings: above PipelineRL's max_model_len
VERL_RESPONSE_LENGTH = 24  # verl's max_new_tokens here: fewer tokens than a request asks for, so the bound shows


def _without(argv: list[str], flag: str) -> list[str]:
    """argv less `flag` and its value."""
    at = argv.index(flag)
    return argv[:at] + argv[at + 2 :]


def _with_value(argv: list[str], flag: str, value: str) -> list[str]:
    at = argv.index(flag)
    return [*argv[: at + 1], value, *argv[at + 2 :]]


def launch_lines(model: str) -> dict[str, list[str]]:
    verl = verl_flags(model, response_length=VERL_RESPONSE_LENGTH)
    verl = _with_value(
        _with_value(_without(verl, "--worker_extension_cls"), "--load_format", "auto"), "--dtype", "float32"
    )
    return {
        "skyrl": _without(skyrl_flags(model), "--worker-extension-cls"),
        "pipelinerl": pipelinerl_flags(model),
        "verl": verl,
    }


pytestmark = pytest.mark.slow  # three server starts: about 10 s on two idle cores


@pytest.fixture(scope="module")
def framework_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    model = make_model_dir(tmp_path_factory.mktemp("launch-model") / "toy", max_position_embeddings=CONTEXT)
    logs = tmp_path_factory.mktemp("launch-logs")
    servers: dict[str, Server] = {}
    try:
        for name, argv in launch_lines(str(model)).items():
            servers[name] = launch(logs, *argv)
        for server in servers.values():
            _wait_healthy(server)
        yield servers
    finally:
        for server in servers.values():
            _stop(server)


def _completion(server: Server, **body: object) -> dict:
    with server.client() as http:
        response = http.post("/v1/completions", json={"prompt": "1+2=", "max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_skyrl_launch_line_serves_its_token_in_route(framework_servers: dict[str, Server]) -> None:
    """SkyRL's client generates through /inference/v1/generate with token ids, no key (its line has none)."""
    server = framework_servers["skyrl"]
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "ignore_eos": True, "logprobs": 0}}
    response = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert len(choice["token_ids"]) == 4 and len(choice["logprobs"]["content"]) == 4
    log = server.log_tail(20000)
    for no_op in ("--mm-processor-cache-gb", "--kv-cache-metrics", "--no-language-model-only"):
        assert f"{no_op}: accepted, no effect" in log


def test_pipelinerl_launch_line_serves_token_ids_as_tokens(framework_servers: dict[str, Server]) -> None:
    server = framework_servers["pipelinerl"]
    with server.client() as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        tokens = [entry["token"] for entry in response.json()["choices"][0]["logprobs"]["content"]]
        assert tokens and all(token.startswith("token_id:") for token in tokens)  # --return-tokens-as-token-ids
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 10000  # its --max_model_len


def test_verl_launch_line_bounds_responses_by_its_generation_overrides(framework_servers: dict[str, Server]) -> None:
    server = framework_servers["verl"]
    completion = _completion(server, max_tokens=100, ignore_eos=True, temperature=0.0)
    # --override_generation_config's max_new_tokens (verl's response_length) bounds every request, as in vLLM
    assert completion["usage"]["completion_tokens"] == VERL_RESPONSE_LENGTH
    assert "--compilation-config: accepted, no effect" in server.log_tail(20000)
