"""The trainer's model for GRPO on a toy task: Hugging Face Qwen3 in fp32, warmed up supervised before RL."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from rlserve.rl.grpo import supervised_warmup
from rlserve.rl.tasks import AdditionTask


def load_trainer_model(model_dir: str | Path, device: str = "cpu") -> torch.nn.Module:
    """The trainer's copy: Hugging Face's Qwen3ForCausalLM in fp32, whose parameter names are checkpoint names."""
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
