"""Every flag of `vllm serve` 0.22-0.33 (rlserve/server/vllm_serve_flags.json, read from each release's parser) is
implemented, a documented no-op, or refused by name with the reason; none is "unrecognized", none takes the model's
place. And each RL framework's own launch command line, as its launcher code at a named commit builds it
(framework_launch_lines.py), parses to what the framework means; test_framework_launch.py starts them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from framework_launch_lines import pipelinerl_flags, prime_rl_flags, skyrl_flags, verl_flags

from rlserve import SamplingParams
from rlserve.cli import build_parser
from rlserve.engine.frontend.args import engine_kwargs, make_engine_config
from rlserve.engine.frontend.validation import EngineLimits
from rlserve.server import vllm_flags
from rlserve.server.vllm_flag_decisions import DECISIONS, Implemented, NoOp, Refused
from rlserve.server.vllm_flags import VllmFlag

pytestmark = pytest.mark.usefixtures("model_names_as_dirs")

RELEASES = (
    "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
    "0.30.0", "0.31.0", "0.32.0", "0.33.0",
)  # fmt: skip
NOT_ACCEPTED = "rlserve-refuses-this"  # a value no Refused flag accepts


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    """`rlserve serve`'s parser, built once: parsing does not change it."""
    return build_parser()._subparsers._group_actions[0].choices["serve"]


def parse(parser: argparse.ArgumentParser, *argv: str) -> argparse.Namespace:
    return parser.parse_args(list(argv))


def refused(parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(parser, *argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def given_values(flag: VllmFlag, value: str) -> list[str]:
    return [] if flag.is_switch else [value]


def test_the_table_has_every_release_and_one_decision_per_flag() -> None:
    assert vllm_flags.vllm_releases() == RELEASES
    flags = vllm_flags.vllm_flags()
    assert len(flags) > 300  # vLLM 0.33 alone has some 320
    assert set(flags) == set(DECISIONS), "a vLLM flag without a decision, or a decision for no vLLM flag"
    for flag in flags.values():
        for spelled in flag.releases.values():
            assert all(part.split("-")[0] in RELEASES for part in spelled.split(","))
    # The flags the frameworks were seen to fail on (issue 29) are all in it.
    for dest in ("mm_processor_cache_gb", "kv_cache_metrics", "distributed_executor_backend", "data_parallel_rpc_port",
                 "max_cpu_loras", "all2all_backend", "additional_config", "override_generation_config",
                 "hf_overrides", "scheduling_policy", "compilation_config", "tool_parser_plugin"):  # fmt: skip
        assert dest in flags


def test_implemented_flags_take_vllms_arity_under_every_spelling(serve_parser: argparse.ArgumentParser) -> None:
    """rlserve's own flag, or an alias of it, for every spelling any release has: a switch takes no value and sets
    what vLLM's spelling sets (rlserve's switches have vLLM's names, so the same sense), any other flag takes one, so
    that what follows is never read as the model."""
    for flag in vllm_flags.vllm_flags().values():
        if not isinstance(DECISIONS[flag.dest], Implemented):
            continue
        for option, sets in flag.options.items():
            action = serve_parser._option_string_actions.get(option)
            assert action is not None, f"{option} (vLLM {flag.releases[option]}) is not a flag of rlserve serve"
            assert (action.nargs == 0) == flag.is_switch, option
            assert action.nargs != "?" or flag.nargs == "?", option
            if flag.is_switch:
                assert switch_sets(action, option) is sets, option


def switch_sets(action: argparse.Action, option: str) -> bool:
    """What a switch's spelling stores (read off the action: parsing it alone may be refused by a check, e.g.
    --enable-auto-tool-choice without --tool-call-parser)."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return not option.startswith("--no-")
    return action.const


def test_every_no_op_flag_is_accepted_changes_nothing_and_says_why(
    serve_parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture
) -> None:
    plain = vars(parse(serve_parser, "m"))
    for flag in vllm_flags.vllm_flags().values():
        decision = DECISIONS[flag.dest]
        if not isinstance(decision, NoOp):
            continue
        for option in flag.options:
            args = vars(parse(serve_parser, "m", option, *given_values(flag, "1")))
            assert args.pop("vllm_no_op_flags") == {option: decision.reason}
            assert args == plain, option
            if flag.nargs in (None, 0):  # one value or none: the model after it is still the model
                assert parse(serve_parser, option, *given_values(flag, "1"), "m").model == plain["model"], option
    serve_parser.print_help()
    help_text = " ".join(capsys.readouterr().out.split())
    assert "accepted, no effect (default: not given): rlserve serves text-only models" in help_text


def test_every_refused_flag_names_itself_and_the_reason(
    serve_parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture
) -> None:
    plain = vars(parse(serve_parser, "m"))
    for flag in vllm_flags.vllm_flags().values():
        decision = DECISIONS[flag.dest]
        if not isinstance(decision, Refused):
            continue
        for option, sets in flag.options.items():
            shown = "true" if sets else "false"
            if flag.is_switch and shown in decision.accepted:
                assert vars(parse(serve_parser, "m", option)) == plain, option  # what rlserve does anyway
                continue
            error = refused(serve_parser, capsys, "m", option, *given_values(flag, NOT_ACCEPTED))
            assert f"{option}: {decision.reason}" in error, error
            assert "unrecognized" not in error and "unknown flag" not in error
        for value in decision.accepted if not flag.is_switch else ():
            assert vars(parse(serve_parser, "m", flag.name, value)) == plain, (flag.name, value)


def test_a_flag_no_release_has_is_refused_as_unknown_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "m", "--no-such-vllm-flag", "3"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--no-such-vllm-flag: unknown flag (neither rlserve nor any vLLM release 0.22-0.33 has this flag)" in error


# ---- the flags with an effect that issue 29 found refused ----


def test_override_generation_config_sets_request_defaults(serve_parser, capsys) -> None:
    args = parse(
        serve_parser, "m", "--override_generation_config", '{"temperature": 0.5, "top_k": -1, "max_new_tokens": 7}'
    )
    assert args.serving_defaults.sampling == {"temperature": 0.5, "top_k": -1, "max_tokens": 7}
    error = refused(serve_parser, capsys, "m", "--override-generation-config", '{"temprature": 1}')
    assert "--override-generation-config: unknown key(s) ['temprature']" in error


def test_additional_config_fp32_lm_head_is_rlserves_fp32_lm_head(serve_parser, capsys) -> None:
    args = parse(serve_parser, "m", "--additional-config", '{"fp32_lm_head": true, "fp32_router_logits": false}')
    assert engine_kwargs(args) == {"lm_head_dtype": "float32"}
    assert "lm_head_dtype" not in engine_kwargs(
        parse(serve_parser, "m", "--additional-config", '{"fp32_lm_head": false}')
    )
    assert "fp32_router_logits: not implemented" in refused(
        serve_parser, capsys, "m", "--additional-config", '{"fp32_router_logits": true}'
    )
    assert "unknown key(s) ['other']" in refused(serve_parser, capsys, "m", "--additional-config", '{"other": 1}')
    assert "expected a JSON object" in refused(serve_parser, capsys, "m", "--additional-config", "[1]")


def test_distributed_executor_backend_is_processes_of_this_host(serve_parser, capsys) -> None:
    for backend in ("mp", "uni", "ray"):
        assert (
            parse(serve_parser, "m", "--distributed-executor-backend", backend).distributed_executor_backend == backend
        )
    assert "rlserve starts its tensor-parallel ranks as processes" in refused(
        serve_parser, capsys, "m", "--distributed-executor-backend", "ray", "-tp", "2"
    )
    assert "--distributed-executor-backend external_launcher" in refused(
        serve_parser, capsys, "m", "--distributed-executor-backend", "external_launcher"
    )


# ---- the frameworks' launch command lines (framework_launch_lines.py) ----


def test_skyrl_launch_parses(serve_parser) -> None:
    args = parse(serve_parser, *skyrl_flags("m"))
    assert Path(args.model).name == "m" and args.distributed_executor_backend == "ray"
    assert engine_kwargs(args)["weight_transfer_config"].backend == "ipc"
    assert engine_kwargs(args)["max_num_seqs"] == 1024 and args.enable_sleep_mode and args.trust_remote_code
    assert set(args.vllm_no_op_flags) == {"--mm-processor-cache-gb", "--kv-cache-metrics", "--no-language-model-only"}


def test_prime_rl_launch_parses(serve_parser) -> None:
    args = parse(serve_parser, *prime_rl_flags("m"))
    kwargs = engine_kwargs(args)
    assert (kwargs["lm_head_dtype"], kwargs["logprobs_mode"], kwargs["max_loras"]) == (
        "float32",
        "processed_logprobs",
        8,
    )
    assert args.serving_defaults.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert set(args.vllm_no_op_flags) == {"--data-parallel-rpc-port", "--max-cpu-loras"}


def test_pipelinerl_launch_parses_and_its_group_flags_are_never_a_model(serve_parser, capsys) -> None:
    args = parse(serve_parser, *pipelinerl_flags("m"))
    assert Path(args.model).name == "m" and args.serving_defaults.return_tokens_as_token_ids
    kwargs = engine_kwargs(args)
    assert kwargs["quantization"] == "bf16_last_layer_fp32" and kwargs["max_model_len"] == 10000
    # Without PipelineRL's debug mode the server joins the trainer's group at start-up and takes its updates on
    # /receive_weight_update, an RL route: without the RL API that is refused by name, never read as a model.
    error = refused(serve_parser, capsys, *pipelinerl_flags("m")[:-1])
    assert "--weight-update-group-init-method: PipelineRL's updates come through /receive_weight_update" in error
    assert "two models" not in error
    with_rl_api = parse(serve_parser, *pipelinerl_flags("m")[:-1], "--enable-rl-api", "--rl-api-auth", "none")
    assert with_rl_api.weight_update_group_world_size == 2 and not with_rl_api.disable_weight_updates


def test_verl_launch_parses(serve_parser) -> None:
    args = parse(serve_parser, *verl_flags("m"))
    assert args.serving_defaults.sampling == {
        "temperature": 1.0,
        "top_k": -1,
        "top_p": 1,
        "repetition_penalty": 1.0,
        "max_tokens": 512,
    }
    assert engine_kwargs(args)["load_format"] == "dummy" and args.disable_log_stats
    assert set(args.vllm_no_op_flags) == {"--compilation-config"}


def test_trl_launch_parses(serve_parser) -> None:
    """TRL 1.16.0's own `trl vllm-serve` command builder (trl/scripts/vllm_serve.py build_command, the released
    package), whose command line is `vllm serve` with TRL's settings; here without vLLM installed, so without
    --enable-scale-out, which TRL adds from vLLM 0.30 on."""
    vllm_serve = pytest.importorskip("trl.scripts.vllm_serve")
    command = vllm_serve.build_command(vllm_serve.ScriptArguments(model="m", port=8001))
    args = parse(serve_parser, *command[command.index("serve") + 1 :])
    kwargs = engine_kwargs(args)
    assert (kwargs["max_logprobs"], kwargs["logprobs_mode"]) == (-1, "processed_logprobs")
    assert kwargs["weight_transfer_config"].backend == "nccl" and args.port == 8001
    assert make_engine_config(args.model, **kwargs).max_logprobs == -1  # vLLM's: no cap below the vocabulary
    limits = EngineLimits(max_model_len=64, vocab_size=100, max_logprobs=-1)
    limits.check([1, 2], SamplingParams(logprobs=100, prompt_logprobs=100))
    with pytest.raises(ValueError, match=r"logprobs: 101 is above the engine's limit"):
        limits.check([1, 2], SamplingParams(logprobs=101))
