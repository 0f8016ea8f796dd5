"""End to end: `rlserve generate` in a fresh interpreter prints one JSON record per sample, matching HF greedy; and
the command line's manners: help, version, defaults in the help, one-line errors, nothing left in the temp dir."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlserve import __version__
from rlserve.cli import build_parser, main
from rlserve.toy import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    if tmpdir is not None:
        tmpdir.mkdir()
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(
        [sys.executable, "-m", "rlserve.cli", *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )


def left_in(tmpdir: Path) -> list[str]:
    """What a run left in its TMPDIR, but torch's compile cache (torchinductor_<user>, shared by every run by
    design, as the Hugging Face cache is)."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def test_generate_prints_greedy_json_with_the_top_logprobs(qwen3_dir, hf, tmp_path: Path) -> None:
    # One subprocess only: a fresh interpreter spends seconds importing torch and transformers.
    result = run_cli(
        "generate", "--model", str(qwen3_dir), "--prompt", "hi", "--max-tokens", "4",
        "--temperature", "0", "--ignore-eos", "--logprobs", "2", "--quiet", tmpdir=tmp_path / "tmp",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    record = json.loads(line)
    prompt_ids = make_tokenizer()("hi").input_ids
    assert record["prompt"] == "hi"
    assert record["finish_reason"] == "length"
    assert record["token_ids"] == hf.greedy(qwen3_dir, prompt_ids, 4)
    rows = hf.logits(qwen3_dir, prompt_ids + record["token_ids"])[1:-1].log_softmax(-1)
    expected = [float(rows[j, t]) for j, t in enumerate(record["token_ids"])]
    assert record["logprobs"] == pytest.approx(expected, abs=1e-4)
    # The 2 most likely tokens of each position, most likely first, as transformers ranks them.
    assert [[t["token_id"] for t in top] for top in record["top_logprobs"]] == rows.topk(2).indices.tolist()
    top_values = [t["logprob"] for top in record["top_logprobs"] for t in top]
    assert top_values == pytest.approx(rows.topk(2).values.flatten().tolist(), abs=1e-4)
    assert left_in(tmp_path / "tmp") == []


def test_generate_without_a_model_removes_the_model_it_built(tmp_path: Path) -> None:
    result = run_cli("generate", "--max-tokens", "2", "--quiet", tmpdir=tmp_path / "tmp")
    assert result.returncode == 0, result.stderr
    assert "removed at exit" in result.stderr and len(result.stdout.strip().splitlines()) == 1
    assert left_in(tmp_path / "tmp") == []


def test_a_bad_model_path_is_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    result = run_cli("generate", "--model", missing, "--quiet")
    assert result.returncode == 2
    why = "no such directory (nor a Hugging Face hub id like Qwen/Qwen3-0.6B)"
    assert result.stderr.strip() == f"rlserve generate: model {missing}: {why}"


def test_bare_rlserve_prints_help_and_version_prints_it(capsys: pytest.CaptureFixture) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlserve") and all(c in out for c in ("generate", "serve", "demo", "toy-model"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rlserve {__version__}"


def test_every_flag_has_help_that_shows_its_default() -> None:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"generate", "toy-model", "serve", "demo", "parity", "run"}
    for name, command in commands.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"rlserve {name} {action.option_strings or action.dest}"
            assert action.help, f"{flag}: no help"
            # A switch is off unless given, and a positional has no default; every other option says its default.
            if action.option_strings and action.nargs != 0 and not action.help.startswith("refused"):
                shown = formatter._get_help_string(action).lower()
                assert "default" in shown, f"{flag}: its help does not show its default"


def test_toy_model_writes_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["toy-model", str(tmp_path / "toy"), "--preset", "tiny", "--architecture", "LlamaForCausalLM"]) == 0
    config = json.loads((tmp_path / "toy" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64
    assert (tmp_path / "toy" / "model.safetensors").is_file() and (tmp_path / "toy" / "tokenizer.json").is_file()
    assert f"rlserve serve {tmp_path / 'toy'}" in capsys.readouterr().out


def test_toy_model_moe_preset(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["toy-model", str(tmp_path / "moe"), "--preset", "tiny-moe"]) == 0
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts_per_tok"] == 2
    assert "Qwen3MoeForCausalLM (tiny-moe)" in capsys.readouterr().out
    # A MoE preset is a MoE architecture's fields: with a dense architecture it is refused by name.
    assert main(["toy-model", str(tmp_path / "bad"), "--preset", "tiny-moe", "--architecture", "Qwen3ForCausalLM"]) == 2
    assert "does not fit preset 'tiny-moe'" in capsys.readouterr().err
