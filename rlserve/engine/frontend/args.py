"""Engine arguments: the command-line flags of every `EngineConfig` field, and the config built from keywords.

The flags are derived from the fields (name, type, default, and `help`/`choices` in their metadata), so the CLI,
the server, the demo and the benchmarks offer every engine option under one spelling each: `--max-num-seqs` for
`max_num_seqs`, `--x/--no-x` for a boolean `x`, JSON for a dataclass-valued field (or vLLM's dotted keys,
`--x.key=value`), and vLLM's `4k`/`4K` for counts marked `human_readable`. Other spellings are one line each in
`FLAG_ALIASES`; `FlagParser` takes vLLM's underscored spelling (`--max_model_len`) of every flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from rlserve.config import EngineConfig, ProfilerConfig, WeightTransferConfig
from rlserve.hub import resolve_model

logger = logging.getLogger(__name__)

VLLM_BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
VLLM_TORCH_PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"  # vLLM before --profiler-config; 0.33 does not read it

# Not flags: `rlserve serve` takes the model as a positional argument, `rlserve generate` as an optional one; the
# front end sets each core's data-parallel rank itself; `rlserve serve --allowed-weight-dirs` (a server flag, which
# its routes check too) sets the core's allowed_weight_dirs.
NOT_FLAGS = frozenset({"model", "data_parallel_rank", "allowed_weight_dirs"})


TAKES_ARGUMENT: Any = object()  # FlagAlias.value of an alias that takes the field's argument


@dataclasses.dataclass(frozen=True)
class FlagAlias:
    """Another spelling of a field's flag: with a `value` it is a switch that sets it, else it takes an argument."""

    flag: str
    field: str
    value: Any = TAKES_ARGUMENT


# The derived names already cover today's --no-async-scheduling and --batch-invariant.
FLAG_ALIASES: tuple[FlagAlias, ...] = (
    FlagAlias("--no-prefix-caching", "enable_prefix_caching", False),
    FlagAlias("-dp", "data_parallel_size"),  # vLLM's short form
    FlagAlias("-tp", "tensor_parallel_size"),
    FlagAlias("-dpb", "data_parallel_backend"),  # vLLM's short form
    FlagAlias("-ep", "enable_expert_parallel", True),
    FlagAlias("-q", "quantization"),
)


def engine_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are command-line flags."""
    return [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_FLAGS]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None) -> None:
    """Add a flag for every engine field (and its aliases). A flag not given stays out of the namespace, so that
    EngineConfig's defaults and vLLM's environment switches (see make_engine_config) apply; `defaults` overrides
    that for a caller with other defaults (a benchmark's larger batches), which then always pass."""
    defaults = dict(defaults or {})
    unknown = sorted(set(defaults) - {f.name for f in engine_fields()})
    if unknown:
        raise ValueError(f"defaults: {unknown} are not engine fields")
    group = parser.add_argument_group("engine", "EngineConfig fields (rlserve.config)")
    hints = typing.get_type_hints(EngineConfig)
    spellings: dict[str, list[str]] = {}  # field -> its aliases that take an argument
    for alias in FLAG_ALIASES:
        if alias.value is TAKES_ARGUMENT:
            spellings.setdefault(alias.field, []).append(alias.flag)
    for f in engine_fields():
        help_text = f.metadata["help"]
        if f.name in defaults:  # the caller's default replaces what the field's help says of its own
            help_text = re.sub(r" \(default: .*\)$", "", help_text) + f" (default: {_shown(defaults[f.name])})"
        elif "default:" not in help_text:  # some helps say what the default means better than its value would
            help_text += f" (default: {_shown(f.default)})"
        if f.metadata.get("human_readable"):
            help_text += "; vLLM's forms too: 4k = 4000, 4K = 4096"
        options: dict[str, Any] = dict(
            dest=f.name,
            default=defaults[f.name] if f.name in defaults else argparse.SUPPRESS,
            help=help_text,
            **_value_options(f, hints[f.name]),
        )
        group.add_argument(flag_name(f.name), *spellings.get(f.name, []), **options)
    for alias in FLAG_ALIASES:
        if alias.value is not TAKES_ARGUMENT:
            group.add_argument(
                alias.flag,
                dest=alias.field,
                action="store_const",
                const=alias.value,
                default=argparse.SUPPRESS,
                help=f"sets {alias.field} to {_shown(alias.value)}",
            )


def _value_options(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    """argparse's `type`/`action`/`choices`/`metavar` for a field of type `hint` (`X | None` is `X`)."""
    value_type = _without_none(hint)
    choices = f.metadata.get("choices")
    if value_type is bool:
        return dict(action=argparse.BooleanOptionalAction)
    if value_type is int and f.metadata.get("human_readable"):
        return dict(type=human_readable_int)
    if value_type in (int, float):
        return dict(type=value_type)
    if value_type is str or typing.get_origin(value_type) is typing.Literal:
        return dict(type=str, choices=choices) if choices else dict(type=str)
    if dataclasses.is_dataclass(value_type):
        return dict(type=_json_parser(value_type), metavar="JSON")
    raise TypeError(f"EngineConfig.{f.name}: no command-line form for type {hint!r}; teach engine.args one")


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An integer as vLLM's flags take it: `4096`, `4k` (4000), `4K` (4096), `25.6k` (25600); lowercase suffixes
    are powers of 1000, uppercase ones powers of 1024 (which take no decimals)."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text}: no decimals with {suffix} (1024s); did you mean {text.lower()}?")
    return int(number) * _BINARY_SUFFIXES[suffix]


human_readable_int.__name__ = "integer (e.g. 4096, 4k, 4K)"  # argparse names the type in its error message


def dash_underscored_flags(argv: Sequence[str], known: Collection[str]) -> list[str]:
    """vLLM's underscore spellings (`--max_model_len 4k`, `--max_model_len=4k`, `--no_enable_prefix_caching`): each
    `--a_b` whose dashed form is a known flag is rewritten to it. Arguments after `--` are values, left alone."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        flag, eq, value = arg.partition("=")
        dashed = flag.replace("_", "-")
        out.append(dashed + eq + value if flag.startswith("--") and dashed != flag and dashed in known else arg)
    return out


def dotted_json_flags(argv: Sequence[str], json_flags: Collection[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON-valued flag's keys (`--profiler-config.profiler=torch`,
    `--profiler-config.torch_profiler_dir DIR`), gathered into one `--profiler-config JSON` at the end, merged over
    that flag's whole JSON if it is given too (a dotted key wins). Values are JSON where they parse (`true`, `3`),
    else strings, as vLLM reads them. Arguments after `--` are values, left alone."""
    out: list[str] = []
    rest: list[str] = []  # from `--` on
    dotted: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest = list(argv[i:])
            break
        flag, eq, value = arg.partition("=")
        name, dot, key = flag.partition(".")
        name = name.replace("_", "-")
        if not (arg.startswith("--") and dot and key and name in json_flags) or (not eq and i + 1 == len(argv)):
            out.append(arg)
            i += 1
            continue
        if not eq:
            value = argv[i + 1]
            i += 1
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        dotted.setdefault(name, {})[key] = parsed
        i += 1
    for name, keys in dotted.items():
        whole: dict[str, Any] = {}
        kept: list[str] = []
        j = 0
        while j < len(out):
            flag, eq, value = out[j].partition("=")
            if flag == name and (eq or j + 1 < len(out)):
                if not eq:
                    value = out[j + 1]
                    j += 1
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    parsed = None
                if not isinstance(parsed, dict):  # left for the flag's own parser to report
                    kept += [name, value]
                else:
                    whole.update(parsed)
            else:
                kept.append(out[j])
            j += 1
        out = [*kept, name, json.dumps(whole | keys)]
    return out + rest


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the help already says it or the option is a switch (off
    unless given); descriptions keep the line breaks of the docstrings they come from."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.nargs == 0 or action.default is argparse.SUPPRESS or "default" in help_text.lower():
            return help_text
        return f"{help_text} (default: {'none' if action.default is None else '%(default)s'})"


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through add_subparsers, its subcommands') that takes vLLM's underscore spellings of
    every flag, runs `checks` on what it parsed (a check's ValueError is a usage error: the message, exit 2), and
    shows every option's default in its help. With an `unknown_flag_hint`, a flag it does not know is a usage error
    naming it (argparse would name it among "unrecognized arguments" only at the top-level parser)."""

    def __init__(
        self,
        *args: Any,
        checks: Sequence[Callable[[argparse.Namespace], None]] = (),
        unknown_flag_hint: str | None = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self.checks = list(checks)
        self.unknown_flag_hint = unknown_flag_hint

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = dash_underscored_flags(sys.argv[1:] if args is None else args, self._option_string_actions)
        json_flags = [flag for flag, action in self._option_string_actions.items() if action.metavar == "JSON"]
        argv = dotted_json_flags(argv, json_flags)
        parsed, extras = super().parse_known_args(argv, namespace)
        unknown = [arg.partition("=")[0] for arg in extras if arg.startswith("-") and arg != "--"]
        if unknown and self.unknown_flag_hint is not None:
            self.error(f"{unknown[0]}: unknown flag ({self.unknown_flag_hint})")
        for check in self.checks:
            try:
                check(parsed)
            except ValueError as e:
                self.error(str(e))
        return parsed, extras


def _without_none(hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (value_type,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return value_type
    return hint


def config_from_dict(cls: type, value: dict[str, Any]) -> Any:
    """A dataclass-valued option from its JSON object: the class's own `from_dict` where it has one (it names keys
    it lacks), else its constructor."""
    from_dict = getattr(cls, "from_dict", None)
    return from_dict(value) if from_dict is not None else cls(**value)


def _json_parser(cls: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        try:
            return config_from_dict(cls, value)
        except ValueError as e:  # argparse shows the message of this kind only
            raise argparse.ArgumentTypeError(str(e)) from e

    parse.__name__ = f"JSON {cls.__name__}"  # argparse names the type in its error message
    return parse


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if dataclasses.is_dataclass(value):
        return json.dumps(dataclasses.asdict(value))
    return str(value)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine keywords of a parsed namespace: only the flags given (or defaulted by the caller)."""
    given = vars(args)
    return {f.name: given[f.name] for f in engine_fields() if f.name in given}


def engine_flags(**kwargs: Any) -> list[str]:
    """Command-line flags for engine keywords (the inverse of engine_kwargs), to start `rlserve serve`."""
    hints = typing.get_type_hints(EngineConfig)
    flags: list[str] = []
    for name, value in kwargs.items():
        if name in NOT_FLAGS or name not in hints:
            raise ValueError(f"{name}: not an engine flag")
        if _without_none(hints[name]) is bool:
            flags.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, dict) or dataclasses.is_dataclass(value):
            flags += [flag_name(name), json.dumps(value if isinstance(value, dict) else dataclasses.asdict(value))]
        else:
            flags += [flag_name(name), str(value)]
    return flags


def check_engine_argument_names(kwargs: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")


def make_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    check_engine_argument_names(kwargs)
    wt = kwargs.get("weight_transfer_config")
    if isinstance(wt, dict):
        kwargs["weight_transfer_config"] = WeightTransferConfig(**wt)
    profiler = kwargs.get("profiler_config")
    if isinstance(profiler, dict):
        kwargs["profiler_config"] = ProfilerConfig.from_dict(profiler)
    if "profiler_config" not in kwargs and os.environ.get(VLLM_TORCH_PROFILER_DIR_ENV):
        # vLLM 0.33 no longer reads it either (it warns of an unknown variable): a script that sets it would otherwise
        # find its start_profile refused with no hint why.
        logger.warning(
            "%s is set but not read (vLLM replaced it with --profiler-config); profiling is off unless the engine "
            "gets profiler_config={'profiler': 'torch', 'torch_profiler_dir': DIR}",
            VLLM_TORCH_PROFILER_DIR_ENV,
        )
    # vLLM turns batch invariance on by environment; scripts written for it set this before building the engine.
    if "batch_invariant" not in kwargs and os.environ.get(VLLM_BATCH_INVARIANT_ENV) == "1":
        kwargs["batch_invariant"] = True
    # A hub id becomes its snapshot directory here, once: the core process and the tokenizer read that directory.
    return EngineConfig(model=resolve_model(model, kwargs.get("revision")), **kwargs)


class UsageContext(enum.StrEnum):
    """vLLM's usage contexts (`vllm.usage.usage_lib.UsageContext`), which its callers pass to
    `create_engine_config` and `AsyncLLM.from_vllm_config`. vLLM reports them in its usage statistics; rlserve sends
    none, so a context changes nothing in the engine."""

    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"


def check_usage_context(usage_context: Any) -> None:
    if not isinstance(usage_context, UsageContext):
        raise ValueError(f"usage_context: expected a UsageContext, got {usage_context!r}")


# Not frozen, unlike rlserve's configs: vLLM's callers assign to `vllm_config.parallel_config` between
# `create_engine_config` and `AsyncLLM.from_vllm_config` (verl sets the data-parallel master port there).
@dataclasses.dataclass
class ParallelConfig:
    """The part of vLLM's `parallel_config` its callers read or set before the engine starts."""

    tensor_parallel_size: int
    data_parallel_size: int
    # vLLM's data-parallel group rendezvous: rlserve's lockstep cores meet there (its --data-parallel-master-port);
    # independent data-parallel cores form no group, so it is unused, as in vLLM with one data-parallel rank.
    data_parallel_master_port: int | None = None


@dataclasses.dataclass(frozen=True)
class VllmConfig:
    """What vLLM's `EngineArgs.create_engine_config` returns, for `AsyncLLM.from_vllm_config`: the checked engine
    config (vLLM's model config is the part of it its callers read) and the parallel config they may adjust."""

    model_config: EngineConfig
    parallel_config: ParallelConfig

    @classmethod
    def of(cls, config: EngineConfig) -> VllmConfig:
        return cls(config, ParallelConfig(config.tensor_parallel_size, config.data_parallel_size))

    def engine_config(self) -> EngineConfig:
        """The engine config with what callers set on `parallel_config`."""
        parallel, config = self.parallel_config, self.model_config
        sizes = (parallel.tensor_parallel_size, parallel.data_parallel_size)
        if sizes != (config.tensor_parallel_size, config.data_parallel_size):
            raise ValueError(
                "parallel_config: tensor_parallel_size / data_parallel_size are the engine arguments' "
                f"{config.tensor_parallel_size} / {config.data_parallel_size}, not {sizes[0]} / {sizes[1]}: "
                "set them on the engine arguments"
            )
        if parallel.data_parallel_master_port is not None and config.data_parallel_lockstep:
            return dataclasses.replace(config, data_parallel_master_port=parallel.data_parallel_master_port)
        return config


def _with_engine_fields(cls: type) -> type:
    """`cls` as a dataclass with EngineConfig's fields (their types resolved, their defaults), constructed by its own
    `__init__`: vLLM's EngineArgs is the dataclass of every engine argument, and its callers read its fields (verl
    spells a False boolean whose default is True as `--no-x` from them)."""
    hints = typing.get_type_hints(EngineConfig)
    fields = dataclasses.fields(EngineConfig)
    cls.__annotations__ = {f.name: hints[f.name] for f in fields}
    for f in fields:
        if f.default is not dataclasses.MISSING:
            setattr(cls, f.name, f.default)
    return dataclasses.dataclass(init=False, repr=False, eq=False)(cls)


@_with_engine_fields
class EngineArgs:
    """vLLM's EngineArgs (and AsyncEngineArgs) as their callers write them: `AsyncEngineArgs(model=..., **engine
    keywords)` for `AsyncLLM.from_engine_args`, or `from_cli_args` of a parsed `vllm serve` command line for
    `AsyncLLM.from_vllm_config`. The keywords are EngineConfig's (a name it lacks is a ValueError naming it); each is
    an attribute too, the others read as their defaults."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        check_engine_argument_names(kwargs)
        self.model = model
        self.kwargs = kwargs
        for name, value in kwargs.items():
            setattr(self, name, value)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine arguments of a parsed command line (`rlserve serve`'s, which takes `vllm serve`'s flags), with
        the weight directories its routes allow: the core checks them again itself."""
        kwargs = engine_kwargs(args)
        if "allowed_weight_dirs" in vars(args):
            kwargs["allowed_weight_dirs"] = tuple(args.allowed_weight_dirs)
        return cls(args.model, **kwargs)

    def create_engine_config(self, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT) -> VllmConfig:
        check_usage_context(usage_context)
        return VllmConfig.of(make_engine_config(self.model, **self.kwargs))


AsyncEngineArgs = EngineArgs
