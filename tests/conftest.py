"""Shared fixtures: tiny checkpoints built once per session, and Hugging Face transformers as the reference.

Every engine test compares rlserve against transformers run on the very same saved weights, in fp32 on CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from vllm_source import SourceUnavailable, VllmSource, find_vllm_source

from rlserve import LLM, RequestOutput, SamplingParams
from rlserve.engine.sched.request import Request
from rlserve.toy import make_model_dir

# Tiny matmuls gain nothing from intra-op threads, and on a shared 2-core box oversubscription makes them ~5x slower.
torch.set_num_threads(1)

# The default initializer_range (0.02) gives near-uniform next-token distributions; 0.2 makes them peaked enough that
# top-k/top-p/min-p cut real tails and greedy argmaxes are clear of float noise.
INIT_RANGE = 0.2

# Model names the tests parametrize over; each maps to one checkpoint directory.
MODEL_NAMES = ("qwen3", "qwen2", "llama", "qwen3-tied", "llama-sharded")

# Small enough to allocate instantly, large enough for every test that does not want a tight cache.
KV_BLOCKS = 256


def make_sharded_model_dir(path: Path, architecture: str = "LlamaForCausalLM", seed: int = 0) -> Path:
    """A toy checkpoint saved in many safetensors shards with a model.safetensors.index.json."""
    make_model_dir(path, architecture, seed=seed, max_shard_size="20KB", initializer_range=INIT_RANGE)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


@pytest.fixture
def model_names_as_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of flags and configs name their model "m" or "model-dir": here those are (empty) directories of the
    working directory, since a model that is neither a directory nor a hub id is refused as the config is made."""
    monkeypatch.chdir(tmp_path)
    for name in ("m", "model-dir"):
        (tmp_path / name).mkdir()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {
        "qwen3": make_model_dir(root / "qwen3", "Qwen3ForCausalLM", seed=1, initializer_range=INIT_RANGE),
        "qwen2": make_model_dir(root / "qwen2", "Qwen2ForCausalLM", seed=2, initializer_range=INIT_RANGE),
        "llama": make_model_dir(root / "llama", "LlamaForCausalLM", seed=3, initializer_range=INIT_RANGE),
        "qwen3-tied": make_model_dir(
            root / "qwen3-tied", "Qwen3ForCausalLM", seed=4, initializer_range=INIT_RANGE, tie_word_embeddings=True
        ),
        "llama-sharded": make_sharded_model_dir(root / "llama-sharded", "LlamaForCausalLM", seed=5),
    }
    assert tuple(dirs) == MODEL_NAMES
    return dirs


@pytest.fixture(scope="session", params=MODEL_NAMES)
def toy_model(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> tuple[str, Path]:
    """(name, directory), parametrized over every toy checkpoint: three architectures, tied, sharded."""
    return request.param, model_dirs[request.param]


@pytest.fixture(scope="session")
def qwen3_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["qwen3"]


@pytest.fixture(scope="session")
def qwen3_alt_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and shapes as qwen3_dir, different weights: the target of weight-update tests."""
    return make_model_dir(
        tmp_path_factory.mktemp("models-alt") / "qwen3-alt", "Qwen3ForCausalLM", seed=11, initializer_range=INIT_RANGE
    )


class HFReference:
    """Loads each checkpoint once into transformers and answers greedy continuations and logits."""

    def __init__(self) -> None:
        self._models: dict[str, PreTrainedModel] = {}
        self._greedy: dict[tuple, list[int]] = {}

    def model(self, path: str | Path) -> PreTrainedModel:
        key = str(path)
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
            # generate() fills unset fields of the config it is given from this one, so "no EOS" must be set here.
            model.generation_config.eos_token_id = None
            self._models[key] = model
        return self._models[key]

    @torch.inference_mode()
    def greedy(
        self,
        path: str | Path,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | list[int] | None = None,
        min_new_tokens: int = 0,
    ) -> list[int]:
        """HF generate(do_sample=False). eos_token_id=None never stops early, like ignore_eos=True."""
        key = (str(path), tuple(prompt_ids), max_new_tokens, str(eos_token_id), min_new_tokens)
        if key in self._greedy:
            return list(self._greedy[key])
        model = self.model(path)
        config = copy.deepcopy(model.generation_config)
        config.do_sample = False
        config.max_new_tokens = max_new_tokens
        config.min_new_tokens = min_new_tokens
        config.eos_token_id = eos_token_id
        config.pad_token_id = 0
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        generated = out[0, len(prompt_ids) :].tolist()
        if eos_token_id is None:
            assert len(generated) == max_new_tokens
        self._greedy[key] = generated
        return list(generated)

    @torch.inference_mode()
    def logits(self, path: str | Path, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(token_ids), vocab] from a single forward; row i predicts token i + 1."""
        return self.model(path)(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()


def build_llm(path: str | Path, in_process: bool = False, **kwargs: Any) -> LLM:
    """An LLM with a small KV cache unless the test sizes it: the CPU default would allocate 1 GiB. The core runs in
    its own process, as by default; `in_process=True` for tests that inspect the core's internals (`engine_core`)."""
    kwargs.setdefault("num_kv_blocks", KV_BLOCKS)
    if not in_process:
        return LLM(str(path), **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")
        return LLM(str(path), **kwargs)


def run_generate(
    llm: LLM, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None = None
) -> list[RequestOutput]:
    """llm.generate, then check the engine is left clean: no request in flight and every KV block back."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_cache_free_blocks"] == stats["kv_cache_blocks"]
    return outputs


def track_requests(llm: LLM) -> list[Request]:
    """Keep every Request the scheduler receives: the engine drops finished ones, their counters stay readable here."""
    seen: list[Request] = []
    scheduler = llm.engine_core.scheduler
    original = scheduler.add_request

    def add_request(request: Request) -> None:
        seen.append(request)
        original(request)

    scheduler.add_request = add_request
    return seen


@pytest.fixture(scope="session")
def tracked() -> Callable[[LLM], list[Request]]:
    """tracked(llm) -> the live list of every Request that llm's scheduler is given from now on."""
    return track_requests


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., LLM]:
    return build_llm


@pytest.fixture(scope="session")
def generate() -> Callable[..., list[RequestOutput]]:
    return run_generate


@pytest.fixture(scope="session")
def vllm_source() -> Callable[[str], VllmSource]:
    """vllm_source(version) -> that vLLM release's own source (tests/vllm_source.py says from where), found once per
    session; the calling test skips, saying why, where there is none."""
    found: dict[str, VllmSource | SourceUnavailable] = {}

    def source(version: str) -> VllmSource:
        if version not in found:
            try:
                found[version] = find_vllm_source(version)
            except SourceUnavailable as unavailable:
                found[version] = unavailable
        result = found[version]
        if isinstance(result, SourceUnavailable):
            pytest.skip(str(result))
        return result

    return source
