"""The CUDA fast path against the CPU reference path (runs only where a GPU is present)."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, SamplingParams
from rlserve.toy import make_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 70, 129)]


def _scaled_head_model(path, factor: float) -> str:
    """A small model whose LM head is scaled: the larger the factor, the more peaked its distribution."""
    from safetensors.torch import load_file, save_file

    make_model_dir(path, preset="small", seed=3)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] *= factor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Peaked (head x8) so greedy choices are not near-ties that rounding could flip.
    return _scaled_head_model(tmp_path_factory.mktemp("gpu"), 8.0)


def _greedy(llm: LLM, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=logprobs)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_fp32_cuda_equals_cpu_reference(model_dir):
    cpu = _greedy(LLM(model_dir, dtype="float32", device="cpu"))
    gpu = _greedy(LLM(model_dir, dtype="float32", device="cuda", num_kv_blocks=512))
    assert [c.token_ids for c in gpu] == [c.token_ids for c in cpu]


def test_bf16_logprobs_close_to_reference_backend(tmp_path):
    # Head x2: peaked enough that logprobs vary (entropy well below uniform), not so much that bf16 rounding of the
    # hidden states, which differs between any two bf16 kernels, is multiplied into large logit differences.
    model_dir = _scaled_head_model(tmp_path, 2.0)
    common = dict(dtype="bfloat16", device="cuda", num_kv_blocks=512)
    fast = _greedy(LLM(model_dir, **common), logprobs=0)
    ref = _greedy(LLM(model_dir, attention_backend="torch", enforce_eager=True, **common), logprobs=0)
    compared, worst = 0, 0.0
    for f, r in zip(fast, ref, strict=True):
        for t_f, t_r, lp_f, lp_r in zip(f.token_ids, r.token_ids, f.logprobs, r.logprobs, strict=True):
            if t_f != t_r:
                break  # after a divergence the contexts differ
            worst = max(worst, abs(lp_f[t_f].logprob - lp_r[t_r].logprob))
            compared += 1
    assert compared >= 100
    assert worst <= 2e-2, f"max |logprob difference| {worst:.4f} over {compared} tokens"


def test_cuda_graphs_match_eager(model_dir):
    graphs = _greedy(LLM(model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=512))
    eager = _greedy(LLM(model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=512, enforce_eager=True))
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]


def test_graphs_stay_valid_after_in_place_weight_update(model_dir, monkeypatch):
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # in process: the test reads the runner's weights
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=512)
    before = _greedy(llm)
    fresh = dict(llm.engine_core.runner.model.checkpoint_weights())
    scaled = [(name, t * 0.5) for name, t in fresh.items() if name.endswith("mlp.down_proj.weight")]
    llm.load_weights(scaled)
    after = _greedy(llm)
    eager = LLM(model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=512, enforce_eager=True)
    eager.load_weights(scaled)
    assert [c.token_ids for c in after] == [c.token_ids for c in _greedy(eager)]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]


def test_sleep_frees_device_memory_and_wake_up_restores_the_outputs(model_dir, monkeypatch):
    monkeypatch.setenv("RLSERVE_ENABLE_MULTIPROCESSING", "0")  # in process: the test measures this process's memory
    llm = LLM(model_dir, dtype="bfloat16", device="cuda", num_kv_blocks=4096)
    before = _greedy(llm)
    runner = llm.engine_core.runner
    held = sum(p.nbytes for p in runner.model.parameters()) + sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    torch.cuda.synchronize()
    awake = torch.cuda.memory_reserved()
    llm.sleep(level=1)
    asleep = torch.cuda.memory_reserved()
    assert awake - asleep >= held, (awake, asleep, held)  # given back to the driver, graphs' pool aside
    llm.wake_up()
    assert runner.cuda_graphs is not None  # recaptured over the new KV cache and weights
    assert [c.token_ids for c in _greedy(llm)] == [c.token_ids for c in before]
