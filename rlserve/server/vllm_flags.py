"""Every flag of `vllm serve` in releases 0.22-0.33, registered on `rlserve serve`'s parser as the table of
vllm_flag_decisions.py decides.

The facts (each flag's spellings, which releases have them, how many values it takes) are in `vllm_serve_flags.json`,
read from each release's own argument parser: the `make_arg_parser` that `vllm serve` uses, built from the release
wheel's sources (VLLM_TARGET_DEVICE=cpu, compiled optional imports such as xgrammar stubbed).

Every flag is registered with vLLM's arity, so a flag's value is never read as a positional (the model), and a flag no
release has is refused as unknown by name (FlagParser's `unknown_flag_hint`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from rlserve.server.vllm_flag_decisions import Implemented, NoOp, Refused, decision_of

FACTS_FILE = "vllm_serve_flags.json"
UNKNOWN_FLAG_HINT = "neither rlserve nor any vLLM release 0.22-0.33 has this flag"


@dataclass(frozen=True)
class VllmFlag:
    """One flag of vLLM's parser: its dest, every spelling (with the value a switch's spelling sets: True, False,
    or None for one that takes a value) and the releases that have each, and its nargs (0 for a switch)."""

    dest: str
    options: Mapping[str, bool | None]
    releases: Mapping[str, str]
    nargs: int | str | None
    json: bool

    @property
    def name(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return self.nargs == 0


@cache
def vllm_flags() -> dict[str, VllmFlag]:
    facts = json.loads(resources.files(__package__).joinpath(FACTS_FILE).read_text())
    return {
        dest: VllmFlag(
            dest=dest,
            options={option: spelled["sets"] for option, spelled in entry["options"].items()},
            releases={option: spelled["releases"] for option, spelled in entry["options"].items()},
            nargs=entry["nargs"],
            json=entry["json"],
        )
        for dest, entry in facts["flags"].items()
    }


@cache
def vllm_releases() -> tuple[str, ...]:
    return tuple(json.loads(resources.files(__package__).joinpath(FACTS_FILE).read_text())["releases"])


def _same_value(given: str, accepted: Sequence[str]) -> bool:
    """`given` is one of `accepted`, as text or as the same JSON (`{}` and `{ }`)."""
    if given in accepted:
        return True
    try:
        parsed = json.loads(given)
    except (json.JSONDecodeError, TypeError):
        return False
    return any(_json_or_none(value) == parsed for value in accepted)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class _VllmFlagAction(argparse.Action):
    """A vLLM flag rlserve does not implement: a NoOp is noted for the start-up warning; a Refused one is a usage error
    naming it and the reason, unless its value is one of the accepted ones."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag: VllmFlag, sets: bool | None, **kwargs: Any):
        self.flag, self.sets, self.decision = flag, sets, decision_of(flag.dest)
        super().__init__(option_strings, "vllm_no_op_flags", nargs=flag.nargs, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        shown = ("true" if self.sets else "false") if self.flag.is_switch else values
        if isinstance(shown, list):
            shown = " ".join(shown)
        if isinstance(self.decision, Refused):
            if shown is None or not _same_value(str(shown), self.decision.accepted):
                accepted = f" (accepted: {', '.join(self.decision.accepted)})" if self.decision.accepted else ""
                parser.error(f"{option}: {self.decision.reason}{accepted}")
            return
        noted = dict(getattr(namespace, "vllm_no_op_flags", {}))
        noted[option or self.flag.name] = self.decision.reason
        namespace.vllm_no_op_flags = noted


def _help(decision: NoOp | Refused) -> str:
    if isinstance(decision, NoOp):
        return f"accepted, no effect (default: not given): {decision.reason}"
    accepted = f" (accepted: {', '.join(decision.accepted)})" if decision.accepted else ""
    return f"refused: {decision.reason}{accepted}"


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Register every vLLM flag the parser lacks: a NoOp or Refused one by the table, and vLLM's other spellings of an
    Implemented one as aliases of rlserve's flag."""
    known = parser._option_string_actions
    no_op = parser.add_argument_group("vLLM flags without effect", "accepted; the reason each cannot matter")
    refused = parser.add_argument_group("vLLM flags refused", "a usage error naming the flag and the reason")
    for flag in vllm_flags().values():
        decision = decision_of(flag.dest)
        spellings = [option for option in flag.options if option not in known]
        if isinstance(decision, Implemented):
            _add_aliases(parser, flag, decision, spellings)
            continue
        group = no_op if isinstance(decision, NoOp) else refused
        by_value: dict[bool | None, list[str]] = {}
        for option in spellings:
            by_value.setdefault(flag.options[option], []).append(option)
        for sets, options in by_value.items():
            metavar = None if flag.is_switch else "JSON" if flag.json else "VALUE"
            group.add_argument(
                *options, action=_VllmFlagAction, flag=flag, sets=sets, help=_help(decision), metavar=metavar
            )


def _add_aliases(parser: argparse.ArgumentParser, flag: VllmFlag, decision: Implemented, spellings: list[str]) -> None:
    target = parser._option_string_actions.get(decision.flag or flag.name)
    if target is None:
        raise ValueError(f"vLLM flag {flag.name} is marked Implemented but rlserve's parser has no {decision.flag}")
    for option in spellings:
        if flag.is_switch:
            value = flag.options[option]
            parser.add_argument(
                option,
                dest=target.dest,
                action="store_const",
                const=value,
                default=argparse.SUPPRESS,
                help=f"vLLM's spelling: sets {target.option_strings[0]} {str(value).lower()}",
            )
        else:
            parser.add_argument(
                option,
                dest=target.dest,
                type=target.type,
                choices=target.choices,
                nargs=target.nargs,
                metavar=target.metavar,
                default=argparse.SUPPRESS,
                help=f"vLLM's spelling of {target.option_strings[0]} (default: that flag's)",
            )
