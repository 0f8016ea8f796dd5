"""Two `rlserve serve` replicas driven as one by AsyncRLServeGroup: one weight-transfer group (trainer rank 0,
replicas ranks 1 and 2), and one broadcast per update reaches both."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import load_file
from server_helpers import API_KEY, MODEL_NAME, Server, free_port

from rlserve.dtypes import dtype_name
from rlserve.rl.client import AsyncRLServeGroup
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import (
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    compare_checksums,
    weight_checksums,
)


def test_one_broadcast_updates_every_replica(replica_servers: list[Server], tmp_path) -> None:
    new = load_file(make_model_dir(tmp_path / "new", seed=9, initializer_range=0.2) / "model.safetensors")
    names = sorted(new)
    update_info = {
        "names": names,
        "dtype_names": [dtype_name(new[n].dtype) for n in names],
        "shapes": [list(new[n].shape) for n in names],
        "packed": True,
        "packed_buffer_size_bytes": 1 << 16,
    }

    async def go() -> tuple[list[dict], list[str], list[dict[str, str]]]:
        async with AsyncRLServeGroup([s.url for s in replica_servers], api_key=API_KEY, timeout=60) as group:
            infos = await group.init_infos("127.0.0.1", free_port())
            _, nccl_group = await asyncio.gather(
                group.init_weight_transfer_engine(infos),
                asyncio.to_thread(NCCLWeightTransferEngine.trainer_init, {**infos[0], "timeout_s": 60}),
            )
            args = NCCLTrainerSendWeightsArgs(group=nccl_group, packed=True, packed_buffer_size_bytes=1 << 16)
            await group.pause(mode="keep")
            await group.start_weight_update()
            await asyncio.gather(
                group.update_weights(update_info),
                asyncio.to_thread(NCCLWeightTransferEngine.trainer_send_weights, ((n, new[n]) for n in names), args),
            )
            await group.finish_weight_update("step-1")
            await group.resume()
            nccl_group.shutdown()
            return infos, await group.get_weight_versions(), await group.weight_checksums()

    infos, versions, checksums = asyncio.run(go())
    assert [(i["rank_offset"], i["world_size"]) for i in infos] == [(1, 3), (2, 3)]
    assert versions == ["step-1", "step-1"]
    expected = weight_checksums(new.items())
    assert all(compare_checksums(expected, c)["match"] for c in checksums)
    # Both serve the new weights: greedy outputs agree with each other.
    body = {"model": MODEL_NAME, "prompt": "replicas", "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    body["return_token_weight_versions"] = True
    outs = []
    for server in replica_servers:
        with server.client() as http:
            choice = http.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["token_weight_versions"] == ["step-1"] * len(choice["token_ids"])
        outs.append(choice["token_ids"])
    assert outs[0] == outs[1]


def test_group_needs_servers_and_one_init_info_each(replica_servers: list[Server]) -> None:
    with pytest.raises(ValueError, match="base_urls"):
        AsyncRLServeGroup([])

    async def go() -> None:
        async with AsyncRLServeGroup([s.url for s in replica_servers], api_key=API_KEY) as group:
            with pytest.raises(ValueError, match="one per replica"):
                await group.init_weight_transfer_engine([{}])

    asyncio.run(go())
