"""A trainer driving a running `rlserve serve` over HTTP, the flow SkyRL and TRL use with vLLM.

Control goes over HTTP (every RL route needs the API key); the bytes go over the `nccl` weight-transfer backend
(gloo for CPU tensors, so this runs anywhere). With --url the script talks to your server, which must have been
started with `--enable-rl-api --api-key KEY --weight-transfer-config '{"backend": "nccl"}'`; without it the script
starts one on a small random model.

    python examples/http_control.py
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from rlserve.dtypes import dtype_name
from rlserve.rl.client import RLServeClient
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, api_key: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "rlserve.cli", "serve", str(model_dir), "--port", str(port), "--api-key", api_key]
    command += ["--enable-rl-api", "--weight-transfer-config", '{"backend": "nccl"}']
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def complete(url: str, api_key: str, prompt: str) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"}
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_weight_versions": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default=os.environ.get("RLSERVE_API_KEY", "example-key"))
    args = ap.parse_args()
    work_dir = tempfile.TemporaryDirectory(prefix="rlserve-http-")  # removed at the end, after the server stops
    work = Path(work_dir.name)
    server = None
    url = args.url
    if url is None:
        port = free_port()
        server = start_server(make_model_dir(work / "model", preset="tiny"), port, args.api_key)
        url = f"http://127.0.0.1:{port}"
    try:
        with RLServeClient(url, api_key=args.api_key, timeout=120) as rl:
            rl.wait_healthy(timeout=120)
            print("before:", complete(url, args.api_key, "1+2=")["text"].encode())

            # 1. The group: every engine worker plus the trainer's rank 0. Both sides block until all have joined,
            #    so the server is asked to join on a thread while this process joins.
            world_size = rl.get_world_size() + 1
            init_info = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=world_size)
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(rl.init_weight_transfer_engine, init_info)
                group = NCCLWeightTransferEngine.trainer_init(init_info)
                joined.result()

            # 2. One update: new weights under checkpoint names (here a different random model of the same shape).
            new_weights = load_file(str(make_model_dir(work / "new", preset="tiny", seed=1) / "model.safetensors"))
            names = sorted(new_weights)
            update_info = dict(
                names=names,
                dtype_names=[dtype_name(new_weights[n].dtype) for n in names],
                shapes=[list(new_weights[n].shape) for n in names],
                packed=True,
            )
            rl.pause(mode="keep")
            rl.start_weight_update()
            with ThreadPoolExecutor(1) as pool:
                received = pool.submit(rl.update_weights, update_info)
                NCCLWeightTransferEngine.trainer_send_weights(
                    ((n, new_weights[n]) for n in names), NCCLTrainerSendWeightsArgs(group=group, packed=True)
                )
                received.result()
            rl.finish_weight_update(weight_version="step-1")
            rl.resume()

            after = complete(url, args.api_key, "1+2=")
            print("after: ", after["text"].encode(), "versions:", set(after["token_weight_versions"]))
            print("server weight version:", rl.get_weight_version())
            group.shutdown()
            return 0 if rl.get_weight_version() == "step-1" else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        work_dir.cleanup()


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
