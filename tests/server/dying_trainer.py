"""A trainer process for the trainer-loss tests: joins the engine's `nccl` (gloo) group as rank 0, broadcasts the first
`SEND` tensors of a checkpoint in sorted order, prints "sent" and waits to be killed (SIGKILL, from the test). It
prints "ready" once its imports are done: the engine's side of the rendezvous waits only the server's (short) timeout.

    python dying_trainer.py MASTER_PORT CHECKPOINT.safetensors SEND
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import torch
from safetensors.torch import load_file

from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

RENDEZVOUS_TIMEOUT_S = 60.0
WAIT_TO_BE_KILLED_S = 120.0  # bounded: a test that forgets to kill it does not leave it behind for long


def main(port: int, checkpoint: str, send: int) -> None:
    torch.set_num_threads(1)
    print("ready", flush=True)
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    group = NCCLWeightTransferEngine.trainer_init({**init_info, "timeout_s": RENDEZVOUS_TIMEOUT_S})
    print("joined", flush=True)
    weights = load_file(checkpoint)

    def first_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for i, name in enumerate(sorted(weights)):
            if i == send:
                print("sent", flush=True)
                time.sleep(WAIT_TO_BE_KILLED_S)
                raise SystemExit("not killed")
            yield name, weights[name]

    NCCLWeightTransferEngine.trainer_send_weights(first_tensors(), NCCLTrainerSendWeightsArgs(group=group))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
