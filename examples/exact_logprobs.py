"""Engine logprobs that equal the trainer's bit for bit: batch-invariant mode and rlserve's trainer-side forward.

An RL loss weighs every token by exp(trainer logprob - behaviour logprob). In batch-invariant mode the engine computes
each request the same way whatever else it is batched with, and rlserve's trainer-side forward runs the same kernels,
so the ratio of an on-policy token is exactly 1: no importance-sampling correction is spent on numerical noise. This
script samples a batch, recomputes its logprobs trainer-side with rlserve's decoder in batch-invariant mode (one
forward: the engine's values, with gradients), takes an optimizer step on a policy-gradient loss, pushes the new
weights into the engine and checks again; then shows that a request's logprobs do not depend on its batch.

    python examples/exact_logprobs.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from rlserve import LLM, SamplingParams
from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import compare_logprobs, trainer_logprobs
from rlserve.toy import make_model_dir

TEMPERATURE = 0.8


def sample(llm: LLM, prompts: list[list[int]], seed: int) -> tuple[list[list[int]], list[list[float]]]:
    params = [
        SamplingParams(temperature=TEMPERATURE, seed=seed + i, max_tokens=24, logprobs=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    samples = [o.outputs[0] for o in outputs]
    completions = [list(s.token_ids) for s in samples]
    logprobs = [[lp[t].logprob for lp, t in zip(s.logprobs, s.token_ids, strict=True)] for s in samples]
    return completions, logprobs


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rlserve-exact-") as work:
        run(make_model_dir(work, preset="tiny", seed=0))


def run(model_dir: Path) -> None:
    # processed_logprobs: the distribution actually sampled (after temperature), the behaviour policy of the ratio.
    llm = LLM(str(model_dir), batch_invariant=True, logprobs_mode="processed_logprobs", num_kv_blocks=256)
    trainer = load_training_model(model_dir, batch_invariant=True)  # rlserve's decoder, trainable
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 12, 20, 33, 7, 16)]

    for step in range(2):
        completions, engine_logprobs = sample(llm, prompts, seed=100 * step)
        mine = trainer_logprobs(trainer, prompts, completions, temperature=TEMPERATURE, processed=True)
        stats = compare_logprobs(engine_logprobs, [m.detach() for m in mine])
        print(
            f"step {step}: {stats.num_tokens} tokens, max |engine - trainer| = {stats.max_abs_diff}, "
            f"mean ratio = {stats.mean_ratio}"
        )
        # A policy-gradient step with made-up advantages, then the engine gets the new weights (in-process here;
        # over ipc or nccl in a real job, see examples/async_grpo.py and examples/http_control.py).
        advantages = torch.randn(len(prompts), generator=gen)
        loss = -torch.stack([a * m.sum() for a, m in zip(advantages, mine, strict=True)]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        llm.load_weights((name, t.detach()) for name, t in trainer.checkpoint_weights())

    # The same request alone and inside a batch of others: the same tokens and the same logprob bits.
    alone = sample(llm, prompts[3:4], seed=7)
    batched = sample(llm, prompts[:3] + prompts[3:4] + prompts[4:], seed=4)  # prompt 3 gets seed 4 + 3 = 7
    print(f"alone == in a batch of {len(prompts)}: {alone[0][0] == batched[0][3] and alone[1][0] == batched[1][3]}")
    llm.shutdown()  # its core process reads the model directory: stopped before that is removed


if __name__ == "__main__":
    main()
