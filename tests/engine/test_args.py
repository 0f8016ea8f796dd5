"""Engine flags come from EngineConfig's fields: every field has one, with its type, choices and help, and the old
spellings still work."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import typing
from typing import Any

import pytest

from rlserve.cli import build_parser
from rlserve.config import EngineConfig, ProfilerConfig, WeightTransferConfig
from rlserve.engine.frontend import args as args_module
from rlserve.engine.frontend.args import (
    FLAG_ALIASES,
    NOT_FLAGS,
    TAKES_ARGUMENT,
    FlagAlias,
    add_engine_arguments,
    engine_fields,
    engine_flags,
    engine_kwargs,
    flag_name,
    make_engine_config,
)

pytestmark = pytest.mark.usefixtures("model_names_as_dirs")

HINTS = typing.get_type_hints(EngineConfig)


def parser(defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(p, defaults)
    return p


def parse(*argv: str) -> dict[str, Any]:
    return engine_kwargs(parser().parse_args(list(argv)))


def other_value(f: dataclasses.Field) -> Any:
    """A valid value of the field that is not its default, so a lost flag cannot pass for the default."""
    choices = f.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != f.default)
    value_type = next((t for t in typing.get_args(HINTS[f.name]) if t is not type(None)), HINTS[f.name])
    samples = {
        bool: not f.default,
        int: 3,
        float: 0.5,
        str: "pkg.mod:Cls",
        WeightTransferConfig: WeightTransferConfig("ipc"),
        ProfilerConfig: ProfilerConfig("torch", "/tmp/rlserve-traces", torch_profiler_with_stack=False),
    }
    return samples[value_type]


def test_every_field_but_the_model_is_a_flag_with_help() -> None:
    options = parser()._option_string_actions
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {f.name for f in engine_fields()} == names - NOT_FLAGS
    for f in engine_fields():
        assert f.metadata["help"], f"{f.name} has no help"
        assert options[flag_name(f.name)].dest == f.name
    for f in ("cpu_kv_cache_bytes", "enable_chunked_prefill", "attention_backend"):  # had no flag before
        assert flag_name(f) in options


def test_every_field_round_trips_through_its_flag() -> None:
    kwargs = {f.name: other_value(f) for f in engine_fields()}
    # Refused with tensor_parallel_size 3; its pair of flags is test_booleans_have_a_pair_of_flags's.
    kwargs["enable_expert_parallel"] = False
    kwargs["enable_lora"] = False  # likewise
    kwargs["grouped_prefix_attention"] = False  # refused with batch_invariant (and tensor_parallel_size 3); likewise
    # fp8 is refused with batch_invariant; this one sets dtype bfloat16 (and lm_head_dtype float32, as given).
    kwargs["quantization"], kwargs["dtype"] = "bf16_last_layer_fp32", "bfloat16"
    parsed = parse(*engine_flags(**kwargs))
    assert parsed == kwargs
    config = make_engine_config("model-dir", **parsed)
    assert {name: getattr(config, name) for name in kwargs} == kwargs


def test_flags_not_given_leave_the_defaults_to_the_config() -> None:
    assert parse() == {}
    assert make_engine_config("m", **parse()) == EngineConfig(model="m")
    # A caller's own defaults (a benchmark's) always pass, and a flag still overrides them.
    p = parser({"max_num_seqs": 1024})
    assert engine_kwargs(p.parse_args([])) == {"max_num_seqs": 1024}
    assert engine_kwargs(p.parse_args(["--max-num-seqs", "8"])) == {"max_num_seqs": 8}
    assert "(default: 1024)" in p.format_help()


@pytest.mark.parametrize("field", [f.name for f in engine_fields() if HINTS[f.name] is bool])
def test_booleans_have_a_pair_of_flags(field: str) -> None:
    name = flag_name(field)
    assert parse(name) == {field: True}
    assert parse("--no-" + name[2:]) == {field: False}


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--no-prefix-caching"], {"enable_prefix_caching": False}),
        (["--no-async-scheduling"], {"async_scheduling": False}),
        (["--batch-invariant"], {"batch_invariant": True}),
    ],
)
def test_todays_spellings_still_work(argv: list[str], expected: dict[str, Any]) -> None:
    assert parse(*argv) == expected


def test_aliases_set_their_field() -> None:
    fields = {f.name: f for f in engine_fields()}
    for alias in FLAG_ALIASES:
        if alias.value is TAKES_ARGUMENT:
            value = engine_flags(**{alias.field: other_value(fields[alias.field])})[1:]
            assert parse(alias.flag, *value) == parse(flag_name(alias.field), *value)
        else:
            assert parse(alias.flag) == {alias.field: alias.value}


def test_a_new_spelling_is_one_table_entry(monkeypatch) -> None:
    extra = (FlagAlias("--max-seqs", "max_num_seqs"), FlagAlias("--max-num-sequences", "max_num_seqs"))
    monkeypatch.setattr(args_module, "FLAG_ALIASES", (*FLAG_ALIASES, *extra))
    assert parse("--max-seqs", "4") == parse("--max-num-sequences", "4") == {"max_num_seqs": 4}


def test_batch_invariant_reaches_the_config_only_when_given(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert make_engine_config("m", **parse()).batch_invariant  # the environment applies
    assert not make_engine_config("m", **parse("--no-batch-invariant")).batch_invariant  # the flag wins


def test_weight_transfer_config_takes_json() -> None:
    assert parse("--weight-transfer-config", '{"backend": "ipc"}') == {
        "weight_transfer_config": WeightTransferConfig(backend="ipc")
    }
    for bad in ("not json", "[1]", '{"no_such_key": 1}'):
        with pytest.raises(argparse.ArgumentError, match="weight-transfer-config"):
            parse("--weight-transfer-config", bad)


def test_profiler_config_takes_vllms_json_and_dotted_keys(tmp_path, monkeypatch, caplog) -> None:
    expected = ProfilerConfig("torch", str(tmp_path), torch_profiler_with_stack=False, max_iterations=4)
    flags = ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})]
    assert parse(*flags[:1], json.dumps(dataclasses.asdict(expected))) == {"profiler_config": expected}
    # vLLM's dotted form (its error message suggests it), alone or over the JSON; values read as JSON where they parse
    monkeypatch.chdir(tmp_path)
    dotted = ["--profiler-config.profiler=torch", "--profiler_config.torch_profiler_dir", "."]
    dotted += ["--profiler-config.torch_profiler_with_stack=false", "--profiler-config.max_iterations", "4"]
    for argv in (dotted, [*flags, *dotted[3:]]):
        assert engine_kwargs(build_parser().parse_args(["generate", *argv])) == {"profiler_config": expected}
    assert ProfilerConfig("torch", "traces").torch_profiler_dir == str(tmp_path / "traces")  # made absolute
    refusals = {
        '{"profiler": "cuda"}': "profiler_config.profiler: 'cuda' is not supported: cudaProfilerStart",
        '{"profiler": "torch"}': "torch_profiler_dir: must be set when profiler is 'torch'",
        '{"torch_profiler_dir": "/t"}': "torch_profiler_dir: only applicable when profiler is 'torch'",
        '{"profiler": "torch", "torch_profiler_dir": "gs://b/t"}': "torch_profiler_dir: a local directory",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "warmup_iterations": 2}': "warmup_iterations: not supp",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "ignore_frontend": false}': "ignore_frontend: only true",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "no_such": 1}': "no_such: unknown key",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": -1}': "max_iterations: must be an int",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["XPU"]}': "activities",
        '{"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["CUDA"]}': "CUDA needs",
    }
    for text, message in refusals.items():
        with pytest.raises((argparse.ArgumentError, ValueError), match=re.escape(message)):
            make_engine_config("model-dir", **parse("--profiler-config", text))
    assert ProfilerConfig.from_dict({"profiler": "torch", "torch_profiler_dir": "/t", "ignore_frontend": True})
    # vLLM dropped the old variable; a script that still sets it is told so instead of finding profiling off
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    with caplog.at_level("WARNING", logger="rlserve.engine.frontend.args"):
        assert make_engine_config("model-dir").profiler_config is None
    assert "VLLM_TORCH_PROFILER_DIR is set but not read" in caplog.text


def test_choices_come_from_the_field() -> None:
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parse("--attention-backend", "cudnn")
    with pytest.raises(ValueError, match="^attention_backend must be one of"):
        EngineConfig(model="m", attention_backend="cudnn")


# serve's --profiler-config serves control routes, which need the RL API
@pytest.mark.parametrize("command", [["generate"], ["serve", "model-dir", "--enable-rl-api", "--api-key", "k"]])
def test_generate_and_serve_take_every_engine_flag(command: list[str]) -> None:
    kwargs = {f.name: other_value(f) for f in engine_fields()}
    args = build_parser().parse_args([*command, *engine_flags(**kwargs)])
    assert engine_kwargs(args) == kwargs
