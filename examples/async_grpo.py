"""Asynchronous GRPO against a live rlserve server, with in-flight weight updates: the loop of `rlserve demo`.

The engine runs as `rlserve serve` in its own process; this script is the trainer. Generation never stops: a pool of
requests keeps the engine busy while the trainer computes, and after every optimizer step the trainer pushes its
weights through the native API (pause(keep) -> start -> update over NCCL/gloo -> finish(version) -> resume).
Requests caught by the pause continue under the new weights; every token says which version sampled it.

    python examples/async_grpo.py --steps 100
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from rlserve.rl.engine_server import EngineServer
from rlserve.rl.grpo import GRPOConfig, Policy
from rlserve.rl.rollout_stream import RolloutStream
from rlserve.rl.tasks import AdditionTask
from rlserve.rl.train_step import train_on_batch
from rlserve.rl.trainer_model import load_trainer_model, warm_up
from rlserve.rl.weight_sync import WeightSync
from rlserve.toy import make_model_dir


async def main(args: argparse.Namespace, workdir: Path) -> None:
    task = AdditionTask()
    model_dir = make_model_dir(workdir / "model", preset="tiny", seed=args.seed)  # random weights, nothing downloaded

    with EngineServer(model_dir, log_path=workdir / "engine.log") as engine:  # `rlserve serve` starts in background
        # A short supervised warm-up stands in for pretraining (RL learns nothing from groups that are all wrong).
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = load_trainer_model(model_dir)
        warm_up(model, tokenizer, task, args.warmup_steps, args.seed)
        policy = Policy(model, GRPOConfig(lr=args.lr, keep_versions=args.max_lag + 1))
        await engine.wait_ready()

        async with engine.control() as control, engine.http() as http:
            sync = WeightSync(engine, control)
            await sync.connect()  # the trainer and the engine join one weight-transfer group
            await sync.push(list(policy.named_weights()), version=policy.version)  # the warmed-up weights: version 0
            rollouts = RolloutStream(
                http, task, tokenizer, group_size=args.group_size, concurrency=args.prompts_per_step, seed=args.seed
            )
            async with rollouts:  # from here on the engine always has work
                for step in range(1, args.steps + 1):
                    # Finished groups, in arrival order; samples older than max_lag versions are dropped.
                    batch = await rollouts.take(args.prompts_per_step, policy.version, args.max_lag)
                    stats = await asyncio.to_thread(train_on_batch, policy, batch, tokenizer.pad_token_id)
                    timing = await sync.push(list(policy.named_weights()), version=policy.version)
                    print(
                        f"step {step}: reward {stats.reward:.3f}, lag {stats.lag_mean:.2f}, "
                        f"mismatch KL {stats.train.mismatch_kl:.1e}, pause {timing.pause_ms:.0f} ms"
                    )
            print(f"engine weight version: {await control.get_weight_version()}")
            sync.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=70)
    parser.add_argument("--seed", type=int, default=0)
    with tempfile.TemporaryDirectory(prefix="async-grpo-") as tmp:
        asyncio.run(main(parser.parse_args(), Path(tmp)))
