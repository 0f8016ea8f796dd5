"""vLLM's NCCL wire over real NCCL: a trainer on cuda:0 that sends as vLLM's trainer does, the engine on cuda:1
receiving into rlserve (skipped without two GPUs: NCCL refuses two ranks on one GPU).

The trainer runs vLLM's own code where it runs from vLLM's source (the `vllm_source` fixture: fetched from the package
index when not cached), for 0.24.0 and 0.33.0: its `StatelessProcessGroup` (the store and its key protocol) and
`packed_nccl_broadcast_producer` (the packing and its stream rotation). The NCCL communicator on that group is
rlserve's vLLM-shaped `PyNcclCommunicator`, as `trainer_init` would build vLLM's: vLLM's own needs its platform, and
vLLM's CUDA platform module imports vLLM's compiled extension (`vllm._C_stable_libtorch`), which a source tree lacks.
The torch-free form: the trainer mints an id with `ncclGetUniqueId`, the engine joins from `nccl_unique_id_b64`. The
same flow over gloo, with vLLM's `ncclUniqueId` too, runs on CPU in tests/server/test_server_vllm_trainer.py.
"""

from __future__ import annotations

import base64
import inspect
import multiprocessing
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlserve import LLM, SamplingParams, WeightTransferConfig
from rlserve.engine.wire.process import free_port
from rlserve.toy import make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL: one rank per GPU)"),
]
TIMEOUT_S = 120.0
BUFFER_BYTES = 1 << 16  # several buckets for the small preset
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 33, 90)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


def _sorted_weights(new_dir: str) -> list[tuple[str, torch.Tensor]]:
    weights = load_file(str(Path(new_dir) / "model.safetensors"))
    return [(name, weights[name].cuda(0)) for name in sorted(weights)]


def _send(comm, weights: list[tuple[str, torch.Tensor]], packed: bool) -> None:
    if packed:  # only where vLLM's source is on the path: the trainer over the store
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iter(weights), comm, 0, lambda item: item[1], BUFFER_BYTES, 2)
    else:
        for _, tensor in weights:  # nccl_engine.trainer_send_weights, unpacked: each tensor in its own dtype
            comm.broadcast(tensor, src=0)
    torch.cuda.synchronize(0)


def _trainer_over_store(port: int, vllm_path: list[str], rounds: list[tuple[str, bool]]) -> None:
    """A trainer on a vLLM release's group (its source first on the path): each round sends (weights dir, packed)."""
    torch.cuda.set_device(0)
    sys.path[:0] = vllm_path
    from vllm.distributed.utils import StatelessProcessGroup

    from rlserve.distributed.device_communicators.pynccl import PyNcclCommunicator

    assert inspect.getsourcefile(StatelessProcessGroup).startswith(vllm_path[0])  # the release's, not the surface's
    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=0, world_size=2)
    comm = PyNcclCommunicator(group, device=0)
    for weights_dir, packed in rounds:
        _send(comm, _sorted_weights(weights_dir), packed)
    comm.destroy()


def _trainer_from_unique_id(ids: multiprocessing.Queue, dirs: list[str]) -> None:
    torch.cuda.set_device(0)
    from rlserve.distributed.device_communicators.pynccl import PyNcclCommunicator
    from rlserve.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

    unique_id = bytes(NCCLLibrary().get_unique_id())
    ids.put(base64.b64encode(unique_id).decode())
    comm = PyNcclCommunicator.from_unique_id_bytes(unique_id, rank=0, world_size=2, device=0)
    for weights_dir in dirs:
        _send(comm, _sorted_weights(weights_dir), packed=False)
    comm.destroy()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    old = make_model_dir(tmp_path_factory.mktemp("old"), preset="small", seed=0)
    new = make_model_dir(tmp_path_factory.mktemp("new"), preset="small", seed=0)
    gen = torch.Generator().manual_seed(1)
    weights = {
        n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in load_file(str(new / "model.safetensors")).items()
    }
    save_file(weights, str(new / "model.safetensors"), metadata={"format": "pt"})
    return old, new


def _update_info(new_dir: Path, packed: bool) -> dict:
    weights = load_file(str(new_dir / "model.safetensors"))
    names = sorted(weights)
    return dict(
        names=names,
        dtype_names=[str(weights[n].dtype).removeprefix("torch.") for n in names],
        shapes=[list(weights[n].shape) for n in names],
        packed=packed,
        packed_buffer_size_bytes=BUFFER_BYTES,
    )


def _outputs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]) for o in outs]


@pytest.fixture(scope="module")
def engines(model_dirs):
    old, new = model_dirs
    common = dict(dtype="float32", device="cuda:1", num_kv_blocks=256)
    fresh = LLM(str(new), **common)
    expected = _outputs(fresh)
    fresh.shutdown()
    llm = LLM(str(old), weight_transfer_config=WeightTransferConfig(backend="nccl"), **common)
    yield llm, expected, _outputs(llm)
    llm.shutdown()


def _run(target, args) -> multiprocessing.Process:
    trainer = multiprocessing.get_context("spawn").Process(target=target, args=args)
    trainer.start()
    return trainer


def _join(trainer: multiprocessing.Process) -> None:
    trainer.join(TIMEOUT_S)
    if trainer.is_alive():
        trainer.kill()
    assert trainer.exitcode == 0


@pytest.mark.parametrize("version", ["0.24.0", "0.33.0"])
def test_vllm_store_rendezvous_unpacked_then_packed(model_dirs, engines, vllm_source, version):
    """The new weights tensor by tensor, then the old ones back packed: both rounds change what the engine serves
    whatever ran before."""
    old, new = model_dirs
    llm, expected, before = engines
    assert before != expected
    rounds = [(new, False, expected), (old, True, before)]
    port = free_port()
    vllm_path = vllm_source(version).path
    trainer = _run(_trainer_over_store, (port, vllm_path, [(str(d), packed) for d, packed, _ in rounds]))
    try:
        llm.init_weight_transfer_engine(
            dict(init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))
        )
        for step, (weights_dir, packed, outputs) in enumerate(rounds):
            llm.start_weight_update()
            llm.update_weights(dict(update_info=_update_info(weights_dir, packed)))
            llm.finish_weight_update(weight_version=f"store-{version}-{step}")
            assert _outputs(llm) == outputs
    finally:
        _join(trainer)


def test_vllm_unique_id_rendezvous(model_dirs, engines):
    """The new weights, then the old ones back: the second round changes what the engine serves whatever ran
    before."""
    old, new = model_dirs
    llm, expected, before = engines
    ids: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    trainer = _run(_trainer_from_unique_id, (ids, [str(new), str(old)]))
    try:
        unique_id_b64 = ids.get(timeout=TIMEOUT_S)
        # No store, so no barrier: the engine must enter ncclCommInitRank while the trainer is in it.
        llm.init_weight_transfer_engine(
            dict(init_info=dict(nccl_unique_id_b64=unique_id_b64, rank_offset=1, world_size=2))
        )
        for step, (weights_dir, outputs) in enumerate([(new, expected), (old, before)]):
            llm.start_weight_update()
            llm.update_weights(dict(update_info=_update_info(weights_dir, packed=False)))
            llm.finish_weight_update(weight_version=f"unique-id-{step}")
            assert _outputs(llm) == outputs
    finally:
        _join(trainer)


def _trainer_that_joins_and_leaves(port: int) -> None:
    torch.cuda.set_device(0)
    from rlserve.distributed.device_communicators.pynccl import PyNcclCommunicator
    from rlserve.distributed.utils import StatelessProcessGroup

    PyNcclCommunicator(StatelessProcessGroup.create("127.0.0.1", port, 0, 2), device=0)
    # Exits without sending: NCCL never times out by itself, the engine's watchdog must.


def test_a_trainer_lost_on_the_vllm_wire_is_detected_within_the_timeout(model_dirs):
    old, new = model_dirs
    timeout_s = 5.0
    llm = LLM(
        str(old),
        dtype="float32",
        device="cuda:1",
        num_kv_blocks=64,
        weight_transfer_config=WeightTransferConfig(backend="nccl"),
        weight_transfer_timeout_s=timeout_s,
    )
    try:
        port = free_port()
        trainer = _run(_trainer_that_joins_and_leaves, (port,))
        llm.init_weight_transfer_engine(
            dict(init_info=dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2))
        )
        _join(trainer)
        llm.start_weight_update()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="the trainer was lost"):
            llm.update_weights(dict(update_info=_update_info(new, packed=True)))
        assert time.monotonic() - started < timeout_s + 30
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still serving
    finally:
        llm.shutdown()
