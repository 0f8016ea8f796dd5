"""`rlserve serve --batch-invariant` over HTTP: logprobs of concurrent requests equal rlserve's trainer-side forward
bit for bit (through JSON), and a request gives the same bits alone as among concurrent others."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server_helpers import MODEL_NAME, Server

from rlserve.rl.train_forward import load_training_model
from rlserve.rl.trainer_logprobs import trainer_logprobs

TEMPERATURE = 0.7
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((4, 19, 33, 8, 26, 12, 41, 2, 17, 30))]


async def _complete(server: Server, prompts: list[list[int]], seeds: list[int]) -> list[tuple[list[int], list[float]]]:
    async def one(http, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
        body = {
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": TEMPERATURE, "seed": seed,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
        }  # fmt: skip
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    async with server.async_client() as http:
        return list(await asyncio.gather(*(one(http, p, s) for p, s in zip(prompts, seeds, strict=True))))


def test_concurrent_logprobs_equal_the_trainer_forward(batch_invariant_server: Server, server_model_dir: Path) -> None:
    seeds = list(range(100, 100 + len(PROMPTS)))
    results = asyncio.run(_complete(batch_invariant_server, PROMPTS, seeds))
    trainer = load_training_model(server_model_dir, batch_invariant=True)
    mine = trainer_logprobs(trainer, PROMPTS, [ids for ids, _ in results], temperature=TEMPERATURE, processed=True)
    for (_, served), values in zip(results, mine, strict=True):
        assert served == values.tolist()
    alone = asyncio.run(_complete(batch_invariant_server, PROMPTS[6:7], seeds[6:7]))[0]
    assert alone == results[6]
