"""The demo's verifiable task: single-digit addition ("3+5=" -> "8"), rewarded by code.

Chosen because a model of about a hundred thousand parameters learns it on a CPU in seconds of supervised warm-up
and minutes of RL, every answer is one or two byte tokens plus end-of-text (so a rollout costs a handful of decode
steps), and the reward is exact: an integer comparison, no judge model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


@dataclass(frozen=True)
class AdditionTask:
    """Prompts "a+b=" with 0 <= a, b <= max_operand; the completion must be the sum, then end of text."""

    max_operand: int = 9

    @property
    def max_completion_tokens(self) -> int:
        # Byte-level tokens: the sum's digits, plus one for end of text.
        return len(str(2 * self.max_operand)) + 1

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(f"{a}+{b}=", str(a + b))

    @staticmethod
    def reward(problem: Problem, completion: str, finish_reason: str | None) -> float:
        """In [0, 1]: 1 for exactly the sum followed by end of text; 0.5 for the sum followed by anything but another
        digit (the right number that did not stop: closer than a wrong one); 0 otherwise."""
        if completion == problem.answer and finish_reason == "stop":
            return 1.0
        rest = completion.removeprefix(problem.answer)
        if rest != completion and not rest[:1].isdigit():
            return 0.5
        return 0.0
