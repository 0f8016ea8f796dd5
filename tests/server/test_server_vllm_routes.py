"""vLLM's routes that RL frameworks call, replayed against a real server: prime-rl's rollouts (`/inference/v1/generate`
with `cache_salt` and `X-Session-ID`) and its checkpoint-directory update, SkyRL's tokenize/detokenize/render, vLLM's
`/update_weights` with a list, the facts routes, and the profiling routes. One server for the module (an engine start
costs seconds)."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import _serve
from safetensors.torch import load_file
from server_helpers import API_KEY, BLOCK_SIZE, MODEL_NAME, Server

from rlserve.engine.worker.tracing import STEP_RANGE
from rlserve.rl.client import RLServeClient
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def allowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer-checkpoints")


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-traces")


@pytest.fixture(scope="module")
def routes_server(
    server_model_dir: Path, allowed_dir: Path, profile_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server-logs") / "vllm-routes.log"
    args = ["--enable-rl-api", "--allowed-weight-dirs", str(allowed_dir)]
    # vLLM's dotted spelling of --profiler-config's keys
    args += ["--profiler-config.profiler", "torch", f"--profiler-config.torch_profiler_dir={profile_dir}"]
    yield from _serve(server_model_dir, log, *args, api_key=API_KEY)


@pytest.fixture
def http(routes_server: Server) -> Iterator[httpx.Client]:
    with routes_server.client() as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"]


def tokenize(http: httpx.Client, text: str) -> list[int]:
    response = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def generate(
    http: httpx.Client, token_ids: list[int], salt: str | None, return_token_weight_versions: bool = False, **params
) -> dict:
    body = {"token_ids": token_ids, "sampling_params": {**GREEDY, "logprobs": 1, **params}, "model": MODEL_NAME}
    if return_token_weight_versions:
        body["return_token_weight_versions"] = True
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "rollout-7"})
    assert response.status_code == 200, response.text
    return response.json()


def test_prime_rl_generate_matches_completions_and_salts_separate_the_prefix_cache(http: httpx.Client) -> None:
    prompt = tokenize(http, "a rollout prompt long enough to fill some cache blocks of sixteen tokens each " * 2)
    assert len(prompt) > 2 * BLOCK_SIZE
    first = generate(http, prompt, "policy-1")
    (choice,) = first["choices"]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == GREEDY["max_tokens"]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert all(c["top_logprobs"][0]["token_id"] == c["token_id"] for c in content)  # the sampled token first
    # vLLM <= 0.24's `token` beside 0.33's `token_id` (prime-rl's renderers client requires it), on every candidate.
    assert all(t["token"] == f"token_id:{t['token_id']}" for c in content for t in [c, *c["top_logprobs"]])
    # vLLM 0.33's generate route sends the spans on a finished choice unasked; rlserve's per-token list on request.
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(choice["token_ids"])}]
    assert choice["token_weight_versions"] is None
    per_token = generate(http, prompt, "policy-1", return_token_weight_versions=True)
    assert per_token["choices"][0]["token_weight_versions"] == ["default"] * len(choice["token_ids"])

    completion = http.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "logprobs": 1, "return_token_ids": True, **GREEDY},
    ).json()["choices"][0]
    assert completion["token_ids"] == choice["token_ids"]
    assert completion["logprobs"]["token_logprobs"] == pytest.approx([c["logprob"] for c in content], abs=1e-5)

    # Same salt: the prompt's full blocks come from the cache. Another salt, or none: nothing is shared.
    cached = generate(http, prompt, "policy-1")["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK_SIZE
    assert generate(http, prompt, "policy-2")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert generate(http, prompt, "policy-2")["choices"][0]["token_ids"] == choice["token_ids"]

    with_prompt_logprobs = generate(http, prompt, "policy-3", prompt_logprobs=1)
    assert len(with_prompt_logprobs["prompt_logprobs"]) == len(prompt)
    assert with_prompt_logprobs["prompt_logprobs"][0] is None


def test_generate_streams_and_refuses_bad_fields(http: httpx.Client) -> None:
    prompt = tokenize(http, "stream me")
    body = {"token_ids": prompt, "sampling_params": GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/inference/v1/generate", json=body) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert tokens == generate(http, prompt, None, logprobs=None)["choices"][0]["token_ids"]
    # The spans cover the whole output, on the last chunk of the choice only (vLLM 0.33's stream).
    spans = [choice["weight_versions"] for c in chunks for choice in c["choices"]]
    assert spans[:-1] == [None] * (len(spans) - 1)
    assert spans[-1] == [{"version": "default", "start": 0, "end": len(tokens)}]
    assert chunks[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]

    url = "/inference/v1/generate"
    good = {"token_ids": prompt, "sampling_params": GREEDY}
    assert_error(http.post(url, json={**good, "token_ids": []}), 400, "token_ids")
    assert_error(http.post(url, json={**good, "token_ids": [10**9]}), 400, "token_ids")
    assert_error(
        http.post(url, json={**good, "sampling_params": {"temperature": "hot"}}), 400, "sampling_params.temperature"
    )
    assert_error(http.post(url, json={**good, "sampling_params": {"top_p": 7}}), 400, "sampling_params.top_p")
    assert_error(http.post(url, json={**good, "sampling_params": {"frobnicate": 1}}), 400, "sampling_params.frobnicate")
    for name, bad in (
        ("presence_penalty", 2.5),
        ("logit_bias", {"seven": 1.0}),
        ("allowed_token_ids", []),
        ("_bad_words_token_ids", [[1]]),  # the server's tokenizer makes these from bad_words
    ):
        assert_error(http.post(url, json={**good, "sampling_params": {name: bad}}), 400, f"sampling_params.{name}")
    assert_error(http.post(url, json={**good, "cache_salt": ""}), 400, "cache_salt")
    assert_error(http.post(url, json={**good, "features": {}}), 400, "features")
    assert_error(http.post(url, json={**good, "model": "other"}), 404, "model")
    assert http.post(url, content=b"{", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(f"{http.base_url}{url}", json=good).status_code == 401  # the API key guards it


def test_prime_rl_renderers_client_parses_generate(routes_server: Server, server_model_dir: Path) -> None:
    """prime-rl's renderer client, run: `renderers.client.generate` of renderers 0.1.12 (the package index's; prime-rl
    559b4477 requires renderers>=0.1.9) renders the chat, posts /inference/v1/generate and raises
    MalformedGenerateResponseError unless each logprobs.content[i].token is the sampled "token_id:N" with a logprob."""
    renderers_client = pytest.importorskip(
        "renderers.client", reason="pip install --no-deps -r requirements-frameworks.txt"
    )
    from renderers import DefaultRendererConfig
    from renderers.base import create_renderer
    from transformers import AutoTokenizer

    renderer = create_renderer(AutoTokenizer.from_pretrained(server_model_dir), DefaultRendererConfig())

    async def go() -> dict:
        client = openai.AsyncOpenAI(base_url=routes_server.url + "/v1", api_key=API_KEY, max_retries=0)
        async with client:
            return await renderers_client.generate(
                client=client,
                renderer=renderer,
                messages=[{"role": "user", "content": "2+3="}],
                model=MODEL_NAME,
                sampling_params={"max_tokens": 6, "temperature": 0.0},
            )

    out = asyncio.run(go())
    assert 0 < len(out["completion_ids"]) == len(out["completion_logprobs"]) <= 6
    assert all(lp <= 0.0 for lp in out["completion_logprobs"]) and out["finish_reason"] in ("stop", "length")


def test_generate_takes_skyrl_and_prime_rl_sampling_fields(http: httpx.Client) -> None:
    """SkyRL's Tinker `sample()` sends `output_kind: 2` (skyrl 0.3.0, remote_inference_client.py); prime-rl's top-k
    head `flat_logprobs` and `extra_args`. Their effects as in vLLM 0.33: outputs are delivered as `stream` says (so a
    kind that says otherwise is refused by name), `flat_logprobs` changes nothing on the wire, `extra_args` travels
    with the request (vLLM's checks; the disaggregation keys vLLM's connectors read are refused)."""
    prompt = tokenize(http, "sample me")
    plain = generate(http, prompt, None)["choices"]
    assert generate(http, prompt, None, output_kind=2)["choices"] == plain
    assert generate(http, prompt, None, output_kind=0)["choices"] == plain
    assert (
        generate(http, prompt, None, flat_logprobs=True, extra_args={"top_k": 5, "big": 2**64 - 1})["choices"] == plain
    )
    url = "/inference/v1/generate"
    good = {"token_ids": prompt, "sampling_params": GREEDY}
    streamed = {**good, "stream": True, "sampling_params": {**GREEDY, "output_kind": 1}}
    with http.stream("POST", url, json=streamed) as response:
        assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
    for bad, stream in (({"output_kind": 1}, False), ({"output_kind": 7}, False), ({"output_kind": 2}, True)):
        body = {**good, "stream": stream, "sampling_params": {**GREEDY, **bad}}
        assert_error(http.post(url, json=body), 400, "sampling_params.output_kind")
    for bad in (
        {"flat_logprobs": "yes"},
        {"extra_args": [1]},
        {"extra_args": {"n": 2**64}},
        {"extra_args": {"kv_transfer_params": {}}},
    ):
        param = f"sampling_params.{next(iter(bad))}"
        assert_error(http.post(url, json={**good, "sampling_params": {**GREEDY, **bad}}), 400, param)


def test_pipelinerl_scores_with_echo_and_max_tokens_0(http: httpx.Client) -> None:
    """PipelineRL 58d39345's preprocessor (pipelinerl/llm.py, get_logprobs_token_ids and get_logprobs_complete):
    /v1/completions with `echo`, `max_tokens: 0` and `logprobs`, read back as it reads them: the last prompt_logprobs
    entries (the completion's tokens), or logprobs.tokens sliced at the tokenized prompt's lengths. vLLM's echo: the
    choice is the prompt, scored (its first token unscored), the one sampled token left out but counted."""
    prompt, completion = tokenize(http, "score this prompt"), tokenize(http, " and its completion")
    body = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 0, "logprobs": 0, "echo": True}
    body |= {"include_stop_str_in_output": True, "skip_special_tokens": False, "n": 1, "stream": False}
    response = http.post("/v1/completions", json={**body, "prompt": prompt + completion})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    scored = [
        {**v, "generated": 0, "token_id": k}
        for lp in choice["prompt_logprobs"][-len(completion) :]
        if lp
        for k, v in lp.items()
    ]
    assert [int(entry["token_id"]) for entry in scored] == completion  # prompt_logprobs 0: each actual token
    reference = {"model": MODEL_NAME, "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0}
    assert (
        http.post("/v1/completions", json=reference).json()["choices"][0]["prompt_logprobs"]
        == choice["prompt_logprobs"]
    )
    assert choice["text"] == http.post("/detokenize", json={"tokens": prompt + completion}).json()["prompt"]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    actual = [next(iter(entry.values()))["logprob"] for entry in choice["prompt_logprobs"][1:]]
    assert logprobs["token_logprobs"][1:] == actual and len(logprobs["tokens"]) == len(prompt + completion)
    assert response.json()["usage"]["completion_tokens"] == 1 and choice["finish_reason"] == "length"

    text_prompt, output = "score this prompt", " and its completion"
    response = http.post("/v1/completions", json={**body, "prompt": text_prompt + output, "logprobs": 1})
    (choice,) = response.json()["choices"]
    prompt_len = len(tokenize(http, text_prompt))
    tokens = choice["logprobs"]["tokens"][prompt_len : len(tokenize(http, text_prompt + output))]
    assert "".join(tokens) == output and choice["text"] == text_prompt + output

    # With generation the echoed prompt comes first, in one response or in a stream's first chunk.
    gen = {"model": MODEL_NAME, "prompt": prompt, "logprobs": 0, **GREEDY, "max_tokens": 4}
    plain = http.post("/v1/completions", json=gen).json()["choices"][0]
    echoed = http.post("/v1/completions", json={**gen, "echo": True}).json()["choices"][0]
    prompt_text = http.post("/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert echoed["text"] == prompt_text + plain["text"]
    # The same tokens' logprobs, up to the float noise of another batch shape (the prompt is scored too).
    sampled = echoed["logprobs"]["token_logprobs"][len(prompt) :]
    assert sampled == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    with http.stream("POST", "/v1/completions", json={**gen, "echo": True, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(prompt) + 4


def test_skyrl_tokenize_detokenize_and_render(http: httpx.Client) -> None:
    text = "hello tokens"
    response = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert response["count"] == len(response["tokens"]) == len(response["token_strs"])
    assert response["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": tokenize(http, text)}).json() == {"prompt": text}

    messages = [{"role": "user", "content": "render me"}]
    chat_tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    rendered = http.post(
        "/v1/chat/completions/render", json={"model": MODEL_NAME, "messages": messages, "max_tokens": 5}
    ).json()
    assert rendered["token_ids"] == chat_tokens
    assert rendered["prompt"] and rendered["sampling_params"]["max_tokens"] == 5
    # The rendered request generates as it is.
    replay = {k: rendered[k] for k in ("token_ids", "sampling_params", "model")}
    assert len(http.post("/inference/v1/generate", json=replay).json()["choices"][0]["token_ids"]) <= 5

    (completion,) = http.post("/v1/completions/render", json={"model": MODEL_NAME, "prompt": [5, 6, 7]}).json()
    assert completion["token_ids"] == [5, 6, 7]

    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(http.post("/tokenize", json={"prompt": 3}), 400, "prompt")
    assert_error(http.post("/tokenize", json={"prompt": "x", "tools": []}), 400, "tools")
    assert_error(http.post("/v1/chat/completions/render", json={"messages": "hi"}), 400, "messages")


def test_facts_routes(routes_server: Server, http: httpx.Client) -> None:
    for path in ("/health", "/health/"):
        response = httpx.get(routes_server.url + path, follow_redirects=False)
        assert response.status_code == 200, (path, response.status_code)
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/server_info", params={"config_format": "json"}).json()
    assert set(info) == {"vllm_config", "vllm_env", "system_env"} and isinstance(info["vllm_config"], dict)
    assert info["vllm_config"]["model_config"]["dtype"].startswith("torch.")  # vLLM's nesting (TRL reads it)
    assert isinstance(http.get("/server_info").json()["vllm_config"], str)
    assert_error(http.get("/server_info", params={"config_format": "yaml"}), 400, "query.config_format")
    assert httpx.get(routes_server.url + "/server_info").status_code == 401


def test_rl_route_shapes(http: httpx.Client) -> None:
    assert http.post("/reset_prefix_cache", params={"reset_running_requests": True}).json() == {"success": True}
    assert http.post("/sleep", params={"level": 0, "mode": "keep"}).json() == {"status": "sleeping", "level": 0}
    assert http.post("/wake_up").status_code == 200
    assert_error(http.post("/sleep", params={"mode": "wait"}), 400, "query.mode")
    assert http.post("/shutdown_weight_transfer_engine").json() == {"message": "Weight transfer shut down"}
    # A list of updates is applied in order; here the first is refused (no transfer engine): 409, not a 5xx.
    info = {"names": [], "dtype_names": [], "shapes": []}
    response = http.post("/update_weights", json={"update_info": [info, info]})
    assert response.status_code == 409 and response.json()["error"]["param"] == "update_info"
    assert_error(http.post("/update_weights", json={"update_info": [info, 3]}), 400, "update_info")
    assert_error(http.post("/update_weights", json={"update_info": []}), 400, "update_info")


def test_profile_routes_as_vllms_behind_the_rl_key(
    routes_server: Server, http: httpx.Client, profile_dir: Path, server: Server
) -> None:
    """vLLM's POST /start_profile and /stop_profile (an empty 200), behind the RL routes' key: a trace of the engine
    core's process; starting twice is vLLM's 409, stopping with no session a no-op; a server without
    --profiler-config answers 404 naming it."""
    assert httpx.post(routes_server.url + "/start_profile").status_code == 401
    assert_error(http.post("/start_profile", json={"profile_prefix": "../up"}), 400, "profile_prefix")
    assert_error(http.post("/start_profile", json={"max_iterations": -1}), 400, "max_iterations")
    assert_error(http.post("/start_profile", json={"profiler_kwargs": {"activities": True}}), 400, "profiler_kwargs")
    assert http.post("/stop_profile").status_code == 200  # no session: nothing to stop
    started = http.post("/start_profile", json={"profile_prefix": "http", "profiler_kwargs": {"with_stack": False}})
    assert (started.status_code, started.content) == (200, b"")
    try:
        again = http.post("/start_profile")
        assert again.status_code == 409 and "already active" in again.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "1+1=", **GREEDY}).status_code == 200
    finally:
        stopped = http.post("/stop_profile")
    assert (stopped.status_code, stopped.content) == (200, b"")
    (trace,) = profile_dir.iterdir()
    assert trace.name.startswith("http_dp0_pp0_tp0_dcp0_ep0_rank0.") and trace.name.endswith(".pt.trace.json.gz")
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith(STEP_RANGE) for e in events)

    with server.client() as unconfigured:  # RL routes on, no --profiler-config
        for route in ("/start_profile", "/stop_profile"):
            response = unconfigured.post(route)
            assert response.status_code == 404 and "--profiler-config" in response.json()["error"]["message"]


def test_prime_rl_checkpoint_directory_update(
    routes_server: Server, http: httpx.Client, allowed_dir: Path, tmp_path: Path
) -> None:
    rl = RLServeClient(routes_server.url, api_key=API_KEY)
    new_dir = make_model_dir(allowed_dir / "step-1", seed=11, initializer_range=0.2)
    new_weights = load_file(new_dir / "model.safetensors")
    prompt = tokenize(http, "after the checkpoint update")
    before_tokens = generate(http, prompt, None)["choices"][0]["token_ids"]
    before = rl.weight_checksums()
    assert compare_checksums(before, weight_checksums(new_weights.items()))["mismatches"]

    # Outside the allowed directories (also through a link out of them): refused, nothing changed.
    outside = make_model_dir(tmp_path / "elsewhere", seed=12, initializer_range=0.2)
    (allowed_dir / "link").symlink_to(outside)
    for path in (outside, allowed_dir / "link", allowed_dir / ".." / outside.parent.name):
        assert_error(http.post("/update_weights", json={"weight_dir": str(path)}), 403, "weight_dir")
    empty = allowed_dir / "empty"
    empty.mkdir()
    assert_error(http.post("/update_weights", json={"weight_dir": str(empty)}), 400, "weight_dir")
    assert_error(http.post("/update_weights", json={"weight_dir": 5}), 400, "weight_dir")
    assert rl.weight_checksums() == before

    # prime-rl's flow: pause keep, load the directory, resume.
    try:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        response = http.post("/update_weights", json={"weight_dir": str(new_dir)})
        assert response.status_code == 200, response.text
    finally:
        assert http.post("/resume").status_code == 200
    assert not compare_checksums(rl.weight_checksums(), weight_checksums(new_weights.items()))["mismatches"]
    assert generate(http, prompt, None)["choices"][0]["token_ids"] != before_tokens
    rl.close()


def test_weight_checker_compare_and_reset_as_vllm(
    http: httpx.Client, allowed_dir: Path, server_model_dir: Path
) -> None:
    """vLLM 0.33's /weight_checker: `compare` needs a baseline and lists every name that differs, is missing or is
    extra; `reset` zeroes every weight (here generation is then refused until they are written again), and
    reload_weights by collective_rpc writes them back from the served checkpoint or an allowed directory."""
    checksums = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    first, second, *_ = sorted(checksums)
    assert http.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json() == {
        "match": True,
        "mismatches": [],
    }
    changed = {**{k: v for k, v in checksums.items() if k != first}, second: "0" * 64, "extra.weight": "0" * 64}
    compared = http.post("/weight_checker", json={"action": "compare", "baseline": changed}).json()
    assert compared == {"match": False, "mismatches": sorted([first, second, "extra.weight"])}
    assert_error(http.post("/weight_checker", json={"action": "compare"}), 400, "baseline")

    assert http.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    compared = http.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json()
    assert compared == {"match": False, "mismatches": sorted(checksums)}
    body = {"model": MODEL_NAME, "prompt": "after reset", **GREEDY}
    refused = http.post("/v1/completions", json=body)
    assert refused.status_code == 503 and "reset zeroed them" in refused.json()["error"]["message"]

    step = make_model_dir(allowed_dir / "reload-step", seed=13, initializer_range=0.2)
    reload = {"method": "reload_weights", "kwargs": {"weights_path": str(step)}}
    assert http.post("/collective_rpc", json=reload).json() == {"results": [None]}
    step_checksums = weight_checksums(load_file(step / "model.safetensors").items())
    assert http.post("/weight_checker", json={"action": "compare", "baseline": step_checksums}).json()["match"]
    assert http.post("/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
    served = weight_checksums(load_file(server_model_dir / "model.safetensors").items())
    assert http.post("/weight_checker", json={"action": "compare", "baseline": served}).json()["match"]
    assert http.post("/v1/completions", json=body).status_code == 200
