"""Hugging Face hub ids as models: resolved from a cache laid out here as huggingface_hub lays out its own, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from rlserve.hub import ModelNotFoundError, resolve_model
from rlserve.toy import make_model_dir, make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REPO = "toy-org/toy-model"
MAIN, TAGGED = "a" * 40, "b" * 40  # commit hashes of two snapshots


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models--toy-org--toy-model/{refs/main, refs/v1, snapshots/<commit>/...}: what `hf download` leaves (its
    snapshot files are links into blobs/; plain files read the same)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--toy-org--toy-model"
    # Peaked (initializer_range 0.2), so that greedy tokens tell the two snapshots apart clear of float noise.
    make_model_dir(repo / "snapshots" / MAIN, preset="tiny", seed=1, initializer_range=0.2)
    make_model_dir(repo / "snapshots" / TAGGED, preset="tiny", seed=2, initializer_range=0.2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(TAGGED)
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # huggingface_hub reads its environment once, at import: set what the environment variables would have set.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_a_directory_is_used_as_given(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model(str(tmp_path), revision="v1") == str(tmp_path)  # a revision is for hub ids only


def test_hub_ids_resolve_to_their_cached_snapshot_at_a_revision(offline: Path) -> None:
    snapshots = offline / "models--toy-org--toy-model" / "snapshots"
    assert Path(resolve_model(REPO)) == snapshots / MAIN
    assert Path(resolve_model(REPO, revision="v1")) == snapshots / TAGGED
    assert Path(resolve_model(REPO, revision=TAGGED)) == snapshots / TAGGED


def test_what_cannot_be_found_is_one_line_with_the_fix(offline: Path) -> None:
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model("toy-org/not-downloaded")
    message = str(missing.value)
    assert "\n" not in message
    assert "HF_HUB_OFFLINE=1" in message and "hf download toy-org/not-downloaded" in message
    assert str(offline) in message  # the cache it looked in
    with pytest.raises(ModelNotFoundError, match="at revision v2: no such directory"):
        resolve_model(REPO, revision="v2")
    with pytest.raises(ModelNotFoundError, match=r"no such directory \(nor a Hugging Face hub id"):
        resolve_model("/no/such/model")


def test_generate_and_serve_take_a_hub_id(hub_cache: Path, tmp_path: Path, hf) -> None:
    """Through the CLI in a fresh interpreter, with the environment variables a user sets: the engine core and the
    tokenizer both read the snapshot; and the server, checked without starting it, serves it under the id."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    script = (
        "import json, sys\n"
        "from rlserve.cli import build_parser, main\n"
        f"args = build_parser().parse_args(['serve', '{REPO}', '--revision', 'v1'])\n"
        "print(json.dumps([args.model, args.served_model_name]))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["generate", "--model", REPO, "--prompt", "hi", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    argv.append("--quiet")
    result = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    served, record = result.stdout.strip().splitlines()
    snapshot = hub_cache / "models--toy-org--toy-model" / "snapshots" / TAGGED
    assert json.loads(served) == [str(snapshot), [REPO]]
    main_snapshot = snapshot.parent / MAIN  # generate gave no revision: main's
    assert json.loads(record)["token_ids"] == hf.greedy(main_snapshot, make_tokenizer()("hi").input_ids, 4)
