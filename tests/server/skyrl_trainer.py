"""SkyRL's trainer-side weight sync, run as a trainer process runs it (rank 0 of a one-rank trainer on gloo), against
an `rlserve serve` that loads SkyRL's worker extension (tests/skyrl_extension.py). SkyRL's own code throughout:
`BroadcastTransferStrategy.create_sender` joins the engines' group (vLLM's `NCCLWeightTransferEngine.trainer_init`, by
vllm's import surface rlserve's, over gloo on the CPU) while `RemoteInferenceClient.init_weight_update_communicator`
sends each server its `BroadcastInitInfo`; the broadcast sender's `send_chunks` then runs the chunked push through
/collective_rpc (`start_weight_update`, `update_weights_nccl` beside `trainer_send_weights`, packed, and
`finish_weight_update`), between the client's keep-mode pause and resume and with the prefix-cache reset SkyRL's
FSDP worker sends around a sync. The skyrl on sys.path first is used (SkyRL's source at a commit, or the release).

    python skyrl_trainer.py SERVER_URL MODEL_NAME CHECKPOINT.safetensors

Prints the world size SkyRL read from the server, as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch
from framework_imports import skyrl_module
from safetensors.torch import load_file

from rlserve import vllm_surface
from rlserve.dtypes import dtype_name
from rlserve.net import get_open_port

TIMEOUT_S = 120.0


async def sync_weights(url: str, model_name: str, weights: dict[str, torch.Tensor]) -> int:
    client_module = skyrl_module("skyrl.backends.skyrl_train.inference_servers.remote_inference_client")
    broadcast = skyrl_module("skyrl.backends.skyrl_train.weight_sync.broadcast_strategy")
    chunk_module = skyrl_module("skyrl.backends.skyrl_train.weight_sync.base")
    names = sorted(weights)
    metadata = {
        "names": names,
        "dtype_names": [dtype_name(weights[n].dtype) for n in names],
        "shapes": [list(weights[n].shape) for n in names],
    }
    # One chunk per tensor, as SkyRL's weight extractor yields them for a model without fused parameters.
    chunks = [
        chunk_module.WeightChunk(names=[n], dtypes=[d], shapes=[s], tensors=[weights[n]])
        for n, d, s in zip(names, metadata["dtype_names"], metadata["shapes"], strict=True)
    ]
    async with client_module.RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model_name
    ) as client:
        _, world_size_per_server = await client.get_world_size()
        init_info = broadcast.BroadcastInitInfo(
            override_existing_receiver=True,
            master_addr="127.0.0.1",
            master_port=get_open_port(),
            rank_offset=1,
            world_size=world_size_per_server + 1,
        )
        # The trainer's end of the rendezvous blocks until the engines join: both ends at once.
        sender, _ = await asyncio.wait_for(
            asyncio.gather(
                asyncio.to_thread(broadcast.BroadcastTransferStrategy.create_sender, init_info, client),
                client.init_weight_update_communicator(init_info),
            ),
            TIMEOUT_S,
        )
        await client.pause(mode="keep")
        await asyncio.wait_for(sender.send_chunks(chunks, weight_metadata=metadata), TIMEOUT_S)
        await client.reset_prefix_cache(reset_running_requests=True)
        await client.resume()
    return world_size_per_server


def main() -> None:
    url, model_name, checkpoint = sys.argv[1:]
    vllm_surface.install()  # SkyRL's sender imports vLLM's NCCL engine
    # SkyRL's sender reads the trainer's rank and ends with a barrier of the trainer's ranks: one here.
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_open_port()}", rank=0, world_size=1)
    try:
        world_size = asyncio.run(sync_weights(url, model_name, load_file(checkpoint)))
    finally:
        torch.distributed.destroy_process_group()
    print(json.dumps({"world_size_per_server": world_size}))


if __name__ == "__main__":
    main()
