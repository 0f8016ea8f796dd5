"""`rlserve serve` takes a vLLM command line: its spellings parse to the same settings, vLLM flags rlserve lacks are
refused by name (exit 2), and a real server started with a framework-style command line serves as it says."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import _stop, _wait_healthy
from server_helpers import Server, launch

from rlserve import LLM, SamplingParams
from rlserve.cli import build_parser
from rlserve.config import EngineConfig
from rlserve.engine.frontend.args import engine_fields, engine_flags, engine_kwargs, make_engine_config
from rlserve.server import serve_flags
from rlserve.server.chat_requests import ChatCompletionRequest
from rlserve.server.defaults import ServingDefaults
from rlserve.server.openai_requests import CompletionRequest
from rlserve.server.serve_flags import DEV_MODE_ENV
from rlserve.toy import make_model_dir

pytestmark = pytest.mark.usefixtures("model_names_as_dirs")


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    monkeypatch.delenv("RLSERVE_API_KEY", raising=False)
    monkeypatch.delenv("RLSERVE_RL_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def refused(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """The usage error of a command line that must not parse (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(*argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---- parsing ----


def test_the_model_is_the_positional_or_model(capsys: pytest.CaptureFixture) -> None:
    assert parse("m").model == "m"
    assert parse("--model", "m").model == "m"
    assert parse("m", "--model", "m").model == "m"
    assert "a model is required" in refused(capsys)
    assert "two models given: MODEL a and --model b" in refused(capsys, "a", "--model", "b")


def test_every_engine_flag_takes_underscores() -> None:
    """Derived, like the flags: every engine field's flag, and its --no- form, spelled with underscores."""
    for f in engine_fields():
        value = not f.default if isinstance(f.default, bool) else f.default
        if value is None:
            continue
        dashed = engine_flags(**{f.name: value})
        underscored = [arg.replace("-", "_").replace("__", "--", 1) if arg.startswith("--") else arg for arg in dashed]
        assert underscored != dashed or "_" not in f.name
        assert engine_kwargs(parse("m", *underscored)) == engine_kwargs(parse("m", *dashed)) == {f.name: value}


def test_underscores_reach_server_flags_and_leave_values_alone() -> None:
    args = parse("m", "--served_model_name", "my_model", "--api_key=k_1", "--max_model_len=1_0", "--enable_rl_api")
    assert args.served_model_name == ["my_model"] and args.api_key == ["k_1"] and args.enable_rl_api
    assert args.max_model_len == 10  # int("1_0"): the value after '=' is not touched
    assert parse("m", "--no_enable_prefix_caching").enable_prefix_caching is False


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600), ("2m", 2_000_000), ("1M", 1 << 20), ("1G", 1 << 30)],
)
def test_lengths_take_vllms_suffixes(text: str, value: int) -> None:
    args = parse("m", "--max-model-len", text, "--max-num-batched-tokens", text, "--cpu-kv-cache-bytes", text)
    assert (args.max_model_len, args.max_num_batched_tokens, args.cpu_kv_cache_bytes) == (value, value, value)


def test_binary_suffixes_take_no_decimals(capsys: pytest.CaptureFixture) -> None:
    assert "did you mean 1.5k" in refused(capsys, "m", "--max-model-len", "1.5K")
    assert "--max-num-seqs" in refused(capsys, "m", "--max-num-seqs", "4k")  # a count of requests: plain ints


def test_api_keys_and_served_model_names_are_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("m", "--api-key", "k1", "k2", "--served-model-name", "a", "b")
    assert serve_flags.api_keys(args) == ["k1", "k2"] and args.served_model_name == ["a", "b"]
    monkeypatch.setenv("RLSERVE_API_KEY", "from-env")
    assert serve_flags.api_keys(parse("m")) == ["from-env"]
    assert serve_flags.api_keys(parse("m", "--api-key", "k")) == ["k"]


def test_tensor_parallel_size_is_a_flag_with_vllms_short_form() -> None:
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"], ["--tensor_parallel_size=2"]):
        assert engine_kwargs(parse("m", *argv)) == {"tensor_parallel_size": 2}


def test_quantization_bf16_last_layer_fp32_is_an_fp32_lm_head(capsys: pytest.CaptureFixture) -> None:
    args = parse("m", "--quantization", "bf16_last_layer_fp32")
    assert engine_kwargs(args) == {"quantization": "bf16_last_layer_fp32"}
    config = make_engine_config("m", **engine_kwargs(args))
    assert (config.dtype, config.lm_head_dtype) == ("bfloat16", "float32")
    config = make_engine_config("m", **engine_kwargs(parse("m", "-q", "bf16_last_layer_fp32", "--dtype", "bfloat16")))
    assert config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="sets dtype bfloat16, but dtype float32 was given"):
        make_engine_config("m", **engine_kwargs(parse("m", "-q", "bf16_last_layer_fp32", "--dtype", "float32")))


def test_quantization_fp8_is_an_engine_flag_and_others_are_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    for method in ("fp8", "fbgemm_fp8"):
        assert make_engine_config("m", **engine_kwargs(parse("m", "-q", method))).quantization == method
    assert "argument --quantization/-q: invalid choice: 'awq'" in refused(capsys, "m", "-q", "awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine_config("m", quantization="awq")
    with pytest.raises(ValueError, match="quantization fp8: not with batch_invariant"):
        make_engine_config("m", quantization="fp8", batch_invariant=True)


def test_lora_flags_parse_as_vllms(capsys: pytest.CaptureFixture) -> None:
    args = parse(
        "m",
        "--enable-lora",
        "--max-loras",
        "3",
        "--max_lora_rank",
        "32",
        "--lora-modules",
        "a=/x/a",
        '{"name": "b", "path": "/x/b", "base_model_name": "m"}',
    )
    assert args.lora_modules == [
        {"name": "a", "path": "/x/a", "base_model_name": None},
        {"name": "b", "path": "/x/b", "base_model_name": "m"},
    ]
    config = make_engine_config("m", **engine_kwargs(args))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 32)
    assert "--lora-modules needs --enable-lora" in refused(capsys, "m", "--lora-modules", "a=/x/a")
    assert "needs a name and a path" in refused(capsys, "m", "--enable-lora", "--lora-modules", "a")
    assert "is not valid JSON" in refused(capsys, "m", "--enable-lora", "--lora-modules", "{nope")
    assert 'expected an object of "name"' in refused(capsys, "m", "--enable-lora", "--lora-modules", '{"nm": 1}')
    assert "not with --api-server-count > 1" in refused(capsys, "m", "--enable-lora", "--api-server-count", "2")


def test_accepted_vllm_flags_say_what_they_do(capsys: pytest.CaptureFixture) -> None:
    args = parse(
        "m", "--enable-sleep-mode", "--trust-remote-code", "--disable-log-stats", "--uvicorn-log-level", "trace"
    )
    assert args.enable_sleep_mode and args.trust_remote_code and args.disable_log_stats
    assert args.uvicorn_log_level == "trace" and args.log_level == "info"
    with pytest.raises(SystemExit):
        parse("--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "rlserve runs no code from the model directory" in help_text
    assert "rlserve logs no periodic stats" in help_text
    assert "/sleep and /wake_up always work" in help_text


def test_device_auto_is_cuda_when_torch_finds_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig(model="m").device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert "device" not in engine_kwargs(parse("m"))  # the config's default (auto) applies
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make_engine_config("m").device == "cuda"
    assert make_engine_config("m", device="cpu").device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert make_engine_config("m", device="auto").device == "cpu"


# ---- server-wide request defaults ----


def write_generation_config(directory: Path, **values: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(values))
    return directory


def test_generation_config_sets_the_request_defaults(tmp_path: Path, capsys) -> None:
    source = write_generation_config(
        tmp_path / "gen", temperature=0.6, top_k=20, top_p=1.0, max_new_tokens=5, repetition_penalty=1.1
    )
    defaults = parse("m", "--generation-config", str(source)).serving_defaults
    assert defaults.sampling == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 1.0,
        "max_tokens": 5,
        "repetition_penalty": 1.1,
    }
    model = write_generation_config(tmp_path / "model", top_p=0.9)
    assert parse(str(model)).serving_defaults.sampling == {"top_p": 0.9}  # auto, the default: the model's file
    assert parse(str(model), "--generation-config", "vllm").serving_defaults.sampling == {}
    assert parse("m").serving_defaults.sampling == {}  # auto without a file: none, as vLLM
    assert "no readable generation_config.json" in refused(capsys, "m", "--generation-config", str(tmp_path / "none"))


def test_generation_defaults_fill_only_what_the_request_leaves_unset() -> None:
    defaults = ServingDefaults(sampling={"temperature": 0.6, "top_k": 20, "max_tokens": 5, "repetition_penalty": 1.1})
    request = CompletionRequest(prompt="x", temperature=0.2, max_tokens=3)
    params = defaults.apply(request, request.sampling_params())
    assert (params.temperature, params.top_k, params.max_tokens, params.repetition_penalty) == (0.2, 20, 3, 1.1)
    request = CompletionRequest(prompt="x", repetition_penalty=1.0)  # sent, even at its "off" value: the request's
    assert defaults.apply(request, request.sampling_params()).repetition_penalty == 1.0
    request = CompletionRequest(prompt="x", max_tokens=100)  # vLLM: max_new_tokens bounds every request
    assert defaults.apply(request, request.sampling_params()).max_tokens == 5
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=None)
    params = defaults.apply(chat, chat.sampling_params())
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 5)


def test_return_tokens_as_token_ids_is_a_default_a_request_can_override() -> None:
    on = ServingDefaults(return_tokens_as_token_ids=True)
    assert on.tokens_as_token_ids(CompletionRequest(prompt="x"))
    assert not on.tokens_as_token_ids(CompletionRequest(prompt="x", return_tokens_as_token_ids=False))
    assert ServingDefaults().tokens_as_token_ids(CompletionRequest(prompt="x", return_tokens_as_token_ids=True))
    assert parse("m", "--return-tokens-as-token-ids").serving_defaults.return_tokens_as_token_ids


def test_chat_template_is_a_file_or_inline_jinja(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert parse("m", "--chat-template", str(path)).serving_defaults.chat_template == template
    assert parse("m", "--chat-template", template).serving_defaults.chat_template == template
    assert parse("m").serving_defaults.chat_template is None
    assert "no such file, and not a Jinja template" in refused(capsys, "m", "--chat-template", "missing.jinja")


def test_tool_call_flags_come_as_vllms_pair(capsys: pytest.CaptureFixture) -> None:
    defaults = parse("m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes").serving_defaults
    assert defaults.enable_auto_tool_choice and not parse("m").serving_defaults.enable_auto_tool_choice
    assert "rlserve implements: hermes" in refused(
        capsys, "m", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"
    )
    assert "needs --tool-call-parser" in refused(capsys, "m", "--enable-auto-tool-choice")
    assert "--enable-auto-tool-choice" in refused(capsys, "m", "--tool-call-parser", "hermes")


def test_reasoning_parser_is_one_rlserve_implements(capsys: pytest.CaptureFixture) -> None:
    assert parse("m", "--reasoning-parser", "qwen3").serving_defaults.reasoning_parser == "qwen3"
    assert parse("m", "--reasoning-parser", "deepseek_r1").serving_defaults.reasoning_parser == "deepseek_r1"
    assert parse("m").serving_defaults.reasoning_parser is None
    error = refused(capsys, "m", "--reasoning-parser", "granite")
    assert "--reasoning-parser granite: not implemented (rlserve implements: deepseek_r1, qwen3, step5)" in error


# ---- the RL routes' key ----


def test_rl_routes_keep_their_key_unless_opted_out(capsys: pytest.CaptureFixture) -> None:
    args = parse("m", "--enable-rl-api", "--api-key", "k")
    assert (args.rl_api_auth, args.host) == ("key", "127.0.0.1")
    assert "needs an API key" in refused(capsys, "m", "--enable-rl-api")
    assert parse("m", "--enable-rl-api", "--rl-api-auth", "none").rl_api_auth == "none"
    assert "the RL routes are off" in refused(capsys, "m", "--rl-api-auth", "none")


def test_keys_of_their_own_and_never_empty(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse("m", "--enable-rl-api", "--rl-api-key", "r")
    assert (serve_flags.api_keys(args), serve_flags.rl_api_keys(args)) == ([], ["r"])  # /v1 keyless, RL keyed
    monkeypatch.setenv("RLSERVE_RL_API_KEY", "from-env")
    assert serve_flags.rl_api_keys(parse("m", "--enable-rl-api")) == ["from-env"]
    monkeypatch.setenv("RLSERVE_RL_API_KEY", "")  # the shell's `VAR=`: unset
    assert "needs an API key" in refused(capsys, "m", "--enable-rl-api")
    monkeypatch.delenv("RLSERVE_RL_API_KEY")
    assert "--api-key (or $RLSERVE_API_KEY): a key must not be empty" in refused(capsys, "m", "--api-key", "k", " ")
    monkeypatch.setenv("RLSERVE_API_KEY", "\t")
    assert "--api-key (or $RLSERVE_API_KEY): a key must not be empty" in refused(capsys, "m")
    monkeypatch.delenv("RLSERVE_API_KEY")
    error = refused(capsys, "m", "--enable-rl-api", "--rl-api-auth", "none", "--rl-api-key", "r")
    assert "--rl-api-key: the RL routes are served without a key" in error


def test_runtime_lora_updating_and_header_timeout_flags(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse("m").runtime_lora_updating is False
    assert parse("m", "--enable-lora", "--enable-runtime-lora-updating").runtime_lora_updating is True
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch, as vLLM reads it
    assert parse("m", "--enable-lora").runtime_lora_updating is True
    assert "needs --enable-lora" in refused(capsys, "m", "--enable-runtime-lora-updating")
    assert parse("m", "--header-timeout-s", "5").header_timeout_s == 5.0
    assert "--header-timeout-s must be a positive" in refused(capsys, "m", "--header-timeout-s", "0")


def test_vllm_dev_mode_serves_the_rl_routes_without_a_key(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    args = parse("m")
    assert (args.enable_rl_api, args.rl_api_auth, args.host) == (True, "none", "127.0.0.1")
    assert parse("m", "--rl-api-auth", "key", "--api-key", "k").rl_api_auth == "key"  # an explicit choice wins
    assert parse("m", "--host", "0.0.0.0").host == "0.0.0.0"  # named on the command line: the operator's choice
    # Were the default address not loopback (vLLM's is every interface), keyless RL routes would not start there.
    monkeypatch.setattr(serve_flags, "DEFAULT_HOST", "0.0.0.0")
    assert "0.0.0.0 is not a loopback address" in refused(capsys, "m")
    assert parse("m", "--rl-api-auth", "key", "--api-key", "k").host == "0.0.0.0"


def test_profiler_config_needs_the_rl_routes(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # /start_profile and /stop_profile are control routes: the flag alone would serve nothing that could use it
    profiler = ["--profiler-config.profiler=torch", "--profiler-config.torch_profiler_dir=/tmp/t"]
    assert "add --enable-rl-api --api-key KEY" in refused(capsys, "m", *profiler)
    assert parse("m", *profiler, "--enable-rl-api", "--api-key", "k").profiler_config.enabled
    assert parse("m", "--profiler-config", '{"profiler": null}').profiler_config.enabled is False  # vLLM's off
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    assert parse("m", *profiler).rl_api_auth == "none"  # vLLM's dev mode: the RL routes, keyless


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("example.org", False),
    ],  # fmt: skip
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert serve_flags.is_loopback(host) is loopback


# ---- real servers ----


def test_llm_takes_model_as_a_keyword(server_model_dir: Path) -> None:
    llm = LLM(model=str(server_model_dir), max_model_len=64, num_kv_blocks=8)
    try:
        assert llm.config.device == ("cuda" if torch.cuda.is_available() else "cpu")
        (out,) = llm.generate(["Hi"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


@pytest.fixture
def vllm_style_server(tmp_path: Path) -> Iterator[Server]:
    """A framework's `vllm serve` command line with `vllm` replaced, on a model whose generation_config.json bounds
    max_tokens at 3 and asks for a repetition penalty."""
    model = make_model_dir(tmp_path / "model", preset="tiny", initializer_range=0.2, max_position_embeddings=4096)
    config = json.loads((model / "generation_config.json").read_text())
    write_generation_config(model, **config, max_new_tokens=3, repetition_penalty=1.1)
    argv = ["--model", str(model), "--max_model_len", "2k", "--enable-prefix-caching", "--no-enable-chunked-prefill"]
    argv += ["--served-model-name", "a", "b", "--api-key", "k1", "k2", "--return-tokens-as-token-ids"]
    argv += ["--generation-config", "auto", "--trust-remote-code", "--uvicorn-log-level", "warning"]
    argv += [
        "--disable-log-stats",
        "--enable-sleep-mode",
        "-tp",
        "1",
        "--data_parallel_size",
        "1",
        "--dtype",
        "float32",
    ]
    argv += ["--gpu-memory-utilization", "0.5", "--seed", "0", "--max-num-seqs", "8", "--max-num-batched-tokens", "2K"]
    server = launch(tmp_path, *argv, headers={"Authorization": "Bearer k2"})
    try:
        _wait_healthy(server)
        yield server
    finally:
        _stop(server)


def test_a_vllm_style_command_line_serves(vllm_style_server: Server) -> None:
    server = vllm_style_server
    with server.client() as http:
        models = http.get("/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("a", 2000), ("b", 2000)]
        body = {"model": "b", "prompt": "1+2=", "logprobs": 1, "temperature": 0.0, "ignore_eos": True}
        completion = http.post("/v1/completions", json={**body, "max_tokens": 10}).json()
        assert completion["model"] == "a"  # responses name the first served name, as vLLM's
        choice = completion["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == 3  # generation_config.json's max_new_tokens bounds max_tokens
        assert all(t.startswith("token_id:") and t[9:].isdigit() for t in choice["logprobs"]["tokens"])
        plain = http.post("/v1/completions", json={**body, "max_tokens": 2, "return_tokens_as_token_ids": False}).json()
        assert not plain["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        assert http.post("/v1/completions", json={**body, "model": "c"}).status_code == 404
    for key, status in (("k1", 200), ("k2", 200), ("k3", 401)):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status
    assert "repetition_penalty" in server.log_tail(20000)  # the request defaults are logged at start-up


def test_dev_mode_rl_routes_answer_without_a_key(server_model_dir: Path, tmp_path: Path) -> None:
    server = launch(tmp_path, str(server_model_dir), "--api-key", "k", env={DEV_MODE_ENV: "1"})
    try:
        _wait_healthy(server)
        assert httpx.get(server.url + "/is_paused", timeout=30).json() == {"is_paused": False}
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # /v1 keeps its key
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert "WITHOUT an API key" in server.log_tail(20000)
    finally:
        _stop(server)


def test_load_format_dummy_parses_and_other_vllm_formats_are_refused(capsys: pytest.CaptureFixture) -> None:
    assert engine_kwargs(parse("m", "--load-format", "dummy")) == {"load_format": "dummy"}
    assert engine_kwargs(parse("m", "--load_format", "safetensors")) == {"load_format": "safetensors"}
    assert "--load-format: invalid choice: 'pt'" in refused(capsys, "m", "--load-format", "pt")


def test_keep_alive_outlasts_client_idle_expiry_and_vllms_variable_sets_it(capsys, monkeypatch) -> None:
    """Idle connections stay open longer than httpx's 5 s pool expiry by default (a client then never reuses one the
    server is closing), and vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE sets it; nonsense there is refused by name."""
    assert parse("m").keep_alive_timeout_s == serve_flags.DEFAULT_KEEP_ALIVE_S > 5.0
    monkeypatch.setenv(serve_flags.KEEP_ALIVE_ENV, "12.5")
    assert parse("m").keep_alive_timeout_s == 12.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(serve_flags.KEEP_ALIVE_ENV, bad)
        assert serve_flags.KEEP_ALIVE_ENV in refused(capsys, "m")
