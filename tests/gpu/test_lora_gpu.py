"""LoRA adapters on the GPU: CUDA-graph decode of a batch mixing the base model and two adapters equals eager decode,
an in-place reload is seen by the captured graphs, and fp32 on CUDA equals the merged checkpoint."""

from __future__ import annotations

import pytest
import torch

from rlserve import LLM, LoRARequest, SamplingParams
from rlserve.toy import make_lora_dir, make_model_dir, merge_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 70, 129, 9)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-gpu")
    model = make_model_dir(root / "model", preset="small", seed=3, initializer_range=0.2)
    a1 = make_lora_dir(root / "a1", model, rank=16, seed=1)
    a2 = make_lora_dir(root / "a2", model, rank=8, seed=2, target_modules=("q_proj", "v_proj", "o_proj"))
    return dict(model=model, a1=a1, a2=a2, merged=merge_lora(root / "merged", model, a1))


def _run(llm: LLM, loras):
    return [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=loras)]


def test_cuda_graph_decode_of_a_mixed_batch_equals_eager(dirs):
    a1, a2 = LoRARequest("a1", 1, str(dirs["a1"])), LoRARequest("a2", 2, str(dirs["a2"]))
    loras = [None, a1, a2, a1, None, a2]
    common = dict(dtype="float32", device="cuda", num_kv_blocks=512, enable_lora=True, max_loras=2, max_lora_rank=16)
    graphs = LLM(str(dirs["model"]), **common)
    eager = LLM(str(dirs["model"]), enforce_eager=True, **common)
    got, expected = _run(graphs, loras), _run(eager, loras)
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids
        for lp_g, lp_e, t in zip(g.logprobs, e.logprobs, g.token_ids, strict=True):
            assert lp_g[t].logprob == pytest.approx(lp_e[t].logprob, abs=1e-4)
    # The graphs read the slots in place: an in-place reload (a1's weights into a2's name) shows in graph decode.
    graphs.add_lora(LoRARequest("a2", 2, str(dirs["a1"]), load_inplace=True))
    reloaded = _run(graphs, [a2] * len(PROMPTS))
    assert [o.token_ids for o in reloaded] == [o.token_ids for o in _run(eager, [a1] * len(PROMPTS))]
    merged = _run(LLM(str(dirs["merged"]), dtype="float32", device="cuda", num_kv_blocks=512), None)
    assert [o.token_ids for o in reloaded] == [o.token_ids for o in merged]
