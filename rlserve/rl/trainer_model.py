"""The trainer's model for GRPO on a toy task, in fp32, warmed up supervised before RL: Hugging Face Qwen3, or
rlserve's decoder in batch-invariant mode when the engine runs in it (the engine's logprobs bit for bit)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rlserve.rl.grpo import supervised_warmup
from rlserve.rl.tasks import AdditionTask
from rlserve.rl.train_forward import load_training_model


def load_trainer_model(model_dir: str | Path, device: str = "cpu", batch_invariant: bool = False) -> torch.nn.Module:
    """The trainer's copy in fp32: Hugging Face's Qwen3ForCausalLM, whose parameter names are checkpoint names; with
    batch_invariant, rlserve's decoder in batch-invariant mode (rlserve.rl.train_forward)."""
    if batch_invariant:
        return load_training_model(model_dir, torch.float32, device, batch_invariant=True)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)


def warm_up(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, task: AdditionTask, steps: int, seed: int
) -> None:
    """Supervised warm-up on the task, so RL starts from a model that is sometimes right (GRPO learns nothing from
    groups that are all wrong)."""
    eos = [tokenizer.eos_token_id]

    def example(rng: random.Random) -> tuple[list[int], list[int]]:
        problem = task.sample(rng)
        return tokenizer(problem.prompt).input_ids, tokenizer(problem.answer).input_ids + eos

    supervised_warmup(model, example, steps, pad_id=tokenizer.pad_token_id, seed=seed)
