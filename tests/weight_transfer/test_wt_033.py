"""vLLM 0.33's weight-transfer API, as its docs describe it, with `vllm` replaced by `rlserve` in the imports: the
trainer-side classes driving an `LLM` (gloo on CPU), the sparse backend (equal to the full update it replaces, refused
whole when invalid), and the engine-side class shapes of both generations."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import rlserve
from rlserve import LLM, SamplingParams
from rlserve.config import WeightTransferConfig
from rlserve.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    ParamMeta,
    RayVLLMWeightSyncClient,
    Replicate,
    Shard,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from rlserve.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
from rlserve.distributed.weight_transfer.sparse_nccl_engine import (
    SparseNCCLTrainerInitInfo,
    SparseNCCLTrainerWeightTransferEngine,
    SparseWeightPatch,
)
from rlserve.rl.engine_server import free_port
from rlserve.toy import make_model_dir
from rlserve.weight_transfer import compare_checksums, weight_checksums
from rlserve.weight_transfer.base import ParallelConfigLike, current_device
from rlserve.weight_transfer.sparse_nccl import SparseDelta

TIMEOUT_S = 60.0
PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CPU = torch.device("cpu")


# --- shapes, no processes ---------------------------------------------------------------------------------------------


def test_an_llm_and_the_http_client_are_weight_sync_clients() -> None:
    assert issubclass(LLM, VLLMWeightSyncClient)
    assert isinstance(HTTPVLLMWeightSyncClient("http://127.0.0.1:1"), VLLMWeightSyncClient)


def test_param_meta_validates_ownership() -> None:
    meta = ParamMeta("w", torch.float32, [4, 2], owners=(0, 1), placements=(Replicate(),))
    assert meta.shape == (4, 2) and meta.mesh_shape == (2,) and meta.placements is None  # all-replicate collapses
    assert ParamMeta("w", torch.float32, (4, 2), owners=(0, 1), placements=(Shard(0),)).placements == (Shard(0),)
    for bad in [dict(owners=(0, 0)), dict(owners=(0, 1), mesh_shape=(3,)), dict(owners=(0,), placements=(Shard(2),))]:
        with pytest.raises(ValueError, match="parameter 'w'"):
            ParamMeta("w", torch.float32, (4, 2), **bad)
    with pytest.raises(ValueError, match="without owners"):
        ParamMeta("w", torch.float32, (4, 2), placements=(Shard(0),))


def test_module_source_and_its_gather_hook() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    gathered: list[str] = []

    def gather(name: str, param: torch.Tensor) -> torch.Tensor:
        gathered.append(name)
        return torch.cat([param, param])  # stands for an all-gather of two row shards

    source = ModuleSource(module, gather=gather, shapes={"0.weight": (4, 3), "0.bias": (4,), "1.weight": (2, 2)})
    assert [(m.name, m.shape) for m in source.metadata] == [
        ("0.weight", (4, 3)),
        ("0.bias", (4,)),
        ("1.weight", (2, 2)),
    ]
    assert gathered == []  # metadata transfers nothing
    full = dict(source.iter_full())
    assert gathered == ["0.weight", "0.bias", "1.weight"] and full["0.weight"].shape == (4, 3)
    assert source.owned_names(3) == ["0.weight", "0.bias", "1.weight"]

    with pytest.raises(TypeError, match="cached_property"):

        class _Uncached(WeightSource):
            @property
            def metadata(self) -> list[ParamMeta]:
                return []


def test_trainer_factory_refuses_an_unknown_backend() -> None:
    class Other(NCCLTrainerInitInfo):
        backend = "nope"

    with pytest.raises(ValueError, match="Invalid weight transfer backend: nope"):
        WeightTransferTrainerFactory.trainer_init(
            Other("127.0.0.1", 1, 2), client=HTTPVLLMWeightSyncClient("http://127.0.0.1:1")
        )


class _Into(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))

    def load_weights(self, weights) -> int:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)
        return 1


class V033Backend(WeightTransferEngine):
    """A backend as written for vLLM 0.33: (config, vllm_config, device, model), receive_weights(update_info) into
    self.model, no discard_weights."""

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)

    def init_transfer_engine(self, init_info) -> None:
        pass

    def receive_weights(self, update_info) -> None:
        self.model.load_weights([("w", torch.full((3,), 7.0))])

    def shutdown(self) -> None:
        pass


class V024Backend(WeightTransferEngine):
    def init_transfer_engine(self, init_info) -> None:
        pass

    def receive_weights(self, update_info, load_weights) -> None:
        load_weights([("w", torch.full((3,), 5.0))])

    def shutdown(self) -> None:
        pass


def test_engine_side_class_shapes_of_both_generations() -> None:
    model = _Into()
    new = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(f"{__name__}:V033Backend"), CPU, worker_index=2, model=model
    )
    assert new.receives_into_model() and new.model is model and new.parallel_config.data_parallel_index == 2
    new.discard_weights(None)  # the default: received, then dropped
    assert model.w.tolist() == [0.0, 0.0, 0.0]
    new.receive(None, lambda weights: None)
    assert model.w.tolist() == [7.0, 7.0, 7.0]

    old = WeightTransferEngineFactory.create_engine(WeightTransferConfig(f"{__name__}:V024Backend"), CPU)
    assert not old.receives_into_model() and old.model is None
    got: list = []
    old.receive(None, got.extend)
    assert got[0][0] == "w"


def test_an_engine_built_as_vllm_0240_builds_it() -> None:
    """0.24.0's `Engine(config, parallel_config, model)`: placed by the parallel config, on the current device."""
    parallel = ParallelConfigLike(rank=1, world_size=2, data_parallel_index=1)
    engine = V024Backend(WeightTransferConfig(f"{__name__}:V024Backend"), parallel, model := _Into())
    assert (engine.parallel_config, engine.model, engine.device) == (parallel, model, current_device())
    with pytest.raises(NotImplementedError, match="does not support sparse weight updates"):
        engine.receive_sparse_weights(None, lambda patches: None)


def test_the_dense_backend_checks_and_refuses_0_24s_sparse_form_by_name() -> None:
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig("nccl"), CPU, model=_Into())
    dense = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[3]]}
    sparse = {"update_kind": "sparse_flat", "num_updates_list": [1]}
    checks = {
        "`num_updates_list` is required": {"update_kind": "sparse_flat"},
        "Sparse metadata is only supported": {"num_updates_list": [1]},
        "cannot be combined with `packed=True`": {**sparse, "packed": True},
        "update_kind='sparse_flat': the nccl backend receives dense updates": sparse,
    }
    for message, fields in checks.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.parse_update_info({**dense, **fields})


class _RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init_weight_transfer_engine(self, init_info) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None) -> None:
        self.calls.append(("finish", weight_version))


@pytest.mark.parametrize("rank", [0, 1])
def test_trainer_engine_hooks_a_subclass_overrides_run_on_the_sender_only(rank: int) -> None:
    """vLLM 0.33's extension points: `_build_worker_init_payload` (what the engine is sent) and
    `_open_trainer_endpoint` (the trainer's end of the group), both on the sender alone."""
    group = object()

    class Trainer(NCCLTrainerWeightTransferEngine):
        @classmethod
        def _build_worker_init_payload(cls, init_info):
            return {**super()._build_worker_init_payload(init_info), "master_port": init_info.master_port + 1}

        def _open_trainer_endpoint(self, init_info) -> None:
            self.model_update_group = group

    client = _RecordingClient()
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=29500, world_size=2, rank=rank, packed=False)
    engine = Trainer.trainer_init(info, client=client, source=ModuleSource(_Into()))
    expected_init = {"master_address": "127.0.0.1", "master_port": 29501, "world_size": 2, "rank_offset": 1}
    expected_init |= {"packed": False, "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}
    assert (client.calls, engine.model_update_group) == (
        ([("init", expected_init)], group) if rank == 0 else ([], None)
    )


def test_sparse_trainer_refuses_a_malformed_patch_before_any_call() -> None:
    engine = SparseNCCLTrainerWeightTransferEngine(client=(client := _RecordingClient()))
    engine.model_update_group = object()  # never reached
    w = torch.tensor([1.0])
    bad = {
        "requires full_shape": SparseWeightPatch("w", torch.tensor([0], dtype=torch.int32), w, None),
        "require int32 indices": SparseWeightPatch("w", torch.tensor([0]), w, (1,)),
        "must have matching lengths": SparseWeightPatch("w", torch.tensor([0, 1], dtype=torch.int32), w, (2,)),
    }
    for message, patch in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.send_weights([patch])
    with pytest.raises(ValueError, match="takes no WeightSource"):
        SparseNCCLTrainerWeightTransferEngine(client=client, source=ModuleSource(_Into()))
    assert client.calls == []


def test_nccl_unique_id_needs_nccl_and_is_validated_by_name() -> None:
    """vLLM 0.33's rules (nccl_common.decode_nccl_unique_id): one rendezvous form, standard base64 of 128 bytes;
    on a CPU engine (no NCCL) a well-formed id is refused by name before anything waits for the trainer."""
    uid = base64.b64encode(bytes(128)).decode()
    bad = {
        "needs NCCL": {"nccl_unique_id_b64": uid},
        "not both": {"nccl_unique_id_b64": uid, "master_address": "127.0.0.1", "master_port": 29500},
        "URL-safe base64 is not accepted": {"nccl_unique_id_b64": base64.urlsafe_b64encode(b"\xfb" * 128).decode()},
        "must decode to 128 bytes, got 127": {"nccl_unique_id_b64": base64.b64encode(bytes(127)).decode()},
        "master_address must be": {},
    }
    for backend in ("nccl", "sparse_nccl"):
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend), CPU, model=_Into())
        for message, fields in bad.items():
            with pytest.raises(ValueError, match=message):
                engine.parse_init_info({**fields, "world_size": 2, "rank_offset": 1})


def test_sparse_delta_counts_bits_and_commits() -> None:
    old = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 1.0, 2.5, 3.0], dtype=torch.bfloat16)
    delta = SparseDelta([("w", old)])
    (patch,) = delta.patches([("w", new)])
    assert patch.indices.tolist() == [0, 2] and patch.indices.dtype == torch.int32  # -0.0 differs from 0.0 in bits
    assert patch.values.tolist() == [-0.0, 2.5] and patch.full_shape == (4,)
    delta.commit([patch])
    assert torch.equal(delta.previous["w"].view(torch.int16), new.view(torch.int16))
    assert delta.patches([("w", new)])[0].indices.numel() == 0
    with pytest.raises(ValueError, match="'w' is"):
        delta.patches([("w", new.float())])


@pytest.mark.parametrize("order", ["as-given", "reversed-subset"])
def test_sparse_delta_chunks_match_a_per_tensor_diff(order: str) -> None:
    """Mixed dtypes (two element sizes share a buffer), chunks smaller than some tensors, and tensors asked for out
    of the order they were first given in: the same patches as diffing each tensor alone, and a commit that makes the
    next diff empty."""
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "a": ((3, 5), torch.bfloat16),
        "b": ((7,), torch.float32),
        "c": ((4, 4), torch.float16),
        "d": ((9,), torch.bfloat16),
    }
    old = {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, dtype) in shapes.items()}
    new = {n: torch.where(torch.rand(t.shape, generator=gen) < 0.3, t + 1, t) for n, t in old.items()}
    delta = SparseDelta(old.items(), chunk_bytes=24)
    names = list(new) if order == "as-given" else ["d", "a", "b"]
    patches = delta.patches((n, new[n]) for n in names)
    assert [p.name for p in patches] == names
    for patch in patches:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[old[patch.name].element_size()]
        expected = (new[patch.name].view(bits) != old[patch.name].view(bits)).flatten().nonzero().view(-1)
        assert patch.indices.dtype == torch.int32 and patch.indices.tolist() == expected.tolist()
        assert torch.equal(patch.values, new[patch.name].flatten()[expected])
    assert sum(p.indices.numel() for p in patches) > 0
    delta.commit(patches)
    for name in names:
        assert torch.equal(delta.previous[name], new[name])
    assert all(p.indices.numel() == 0 for p in delta.patches((n, new[n]) for n in names))
    if "c" not in names:
        assert torch.equal(delta.previous["c"], old["c"])  # not asked for, not touched


# --- a trainer of 0.33 classes updates an LLM (gloo) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The engine's checkpoint and the trainer's next version (every weight moved)."""
    old = make_model_dir(tmp_path_factory.mktemp("old"), seed=0)
    new = make_model_dir(tmp_path_factory.mktemp("new"), seed=1)
    return old, new


def _trainer_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)


def _checksums(module: torch.nn.Module) -> dict[str, str]:
    return weight_checksums(module.state_dict().items())


def _greedy(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_trainer_engine_updates_an_llm_over_gloo(checkpoints: tuple[Path, Path], make_llm) -> None:
    old, new = checkpoints
    llm = make_llm(old, weight_transfer_config=WeightTransferConfig("nccl"))
    trainer_model = _trainer_model(new)
    init_info = NCCLTrainerInitInfo("127.0.0.1", free_port(), llm.get_world_size() + 1, timeout_s=TIMEOUT_S)
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=llm, source=ModuleSource(trainer_model))
    try:
        engine.send_weights()
        assert compare_checksums(_checksums(trainer_model), llm.weight_checksums())["match"]
        with torch.no_grad():  # a second round: the engine reuses the metadata it was sent (an empty update_info)
            trainer_model.model.norm.weight.mul_(1.5)
        engine.send_weights()
        assert compare_checksums(_checksums(trainer_model), llm.weight_checksums())["match"]
        with pytest.raises(RuntimeError, match="no speculative draft model"):
            llm.start_draft_weight_update()
    finally:
        engine.shutdown()


# --- sparse ----------------------------------------------------------------------------------------------------------


def _moved(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """`weights` with about `fraction` of each tensor's elements nudged, as a small optimizer step leaves them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=gen) < fraction
        out[name] = torch.where(mask, t + 1e-3 * torch.randn(t.shape, generator=gen), t)
    return out


@pytest.fixture(scope="module")
def sparse_llm(checkpoints: tuple[Path, Path], make_llm) -> Iterator[tuple[LLM, object, SparseDelta]]:
    old, _ = checkpoints
    llm = make_llm(old, weight_transfer_config=WeightTransferConfig("sparse_nccl"))
    init_info = SparseNCCLTrainerInitInfo("127.0.0.1", free_port(), 2, timeout_s=TIMEOUT_S)
    engine = WeightTransferTrainerFactory.trainer_init(init_info, client=llm)
    # The trainer starts from the version the engine loaded and diffs every later one against the last it sent.
    delta = SparseDelta(_trainer_model(old).state_dict().items())
    yield llm, engine, delta
    engine.shutdown()


def test_sparse_update_equals_the_full_update_it_replaces(sparse_llm) -> None:
    llm, engine, delta = sparse_llm
    for step in range(2):
        new = _moved(delta.previous, fraction=0.03, seed=step)
        patches = delta.patches(new.items())
        changed = sum(p.indices.numel() for p in patches)
        assert 0 < changed < 0.06 * sum(t.numel() for t in new.values())
        engine.send_weights(patches)
        delta.commit(patches)
        assert compare_checksums(weight_checksums(new.items()), llm.weight_checksums())["match"]
    assert _greedy(llm)  # the patched engine still generates


@pytest.mark.parametrize(
    "corrupt, error",
    [
        (
            lambda p: SparseWeightPatch(p.name, p.indices.clone().fill_(1 << 30), p.values, p.full_shape),
            "out of bounds",
        ),
        (lambda p: SparseWeightPatch("model.no_such.weight", p.indices, p.values, p.full_shape), "does not exist"),
        (lambda p: SparseWeightPatch(p.name, p.indices, p.values.bfloat16(), p.full_shape), "the model serves"),
    ],
    ids=["bad-index", "bad-name", "wrong-dtype"],
)
def test_invalid_sparse_update_is_refused_whole(sparse_llm, corrupt, error: str) -> None:
    llm, engine, delta = sparse_llm
    before = llm.weight_checksums()
    patches = delta.patches(_moved(delta.previous, fraction=0.03, seed=7).items())
    patches[-1] = corrupt(patches[-1])  # the valid patches before it must not be written either
    with pytest.raises(Exception, match=error):
        engine.send_weights(patches)
    assert llm.abandon_weight_update() == "unchanged"
    assert llm.weight_checksums() == before
    assert llm.not_serving is None and _greedy(llm)


def test_trainer_engine_updates_an_llm_ray_actor(checkpoints: tuple[Path, Path]) -> None:
    """`RayVLLMWeightSyncClient` drives a plain Ray actor of `LLM` through `.remote` calls of its methods (with the
    `ray` extra)."""
    ray = pytest.importorskip("ray")
    old, new = checkpoints
    # address="local": a cluster of its own, never one another process left running on this machine.
    ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        # The actor imports rlserve from this checkout, whether or not it is installed.
        path = os.pathsep.join(filter(None, [str(Path(rlserve.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
        env = {"RLSERVE_ENABLE_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        actor = (
            ray.remote(LLM)
            .options(runtime_env={"env_vars": env})
            .remote(str(old), weight_transfer_config=WeightTransferConfig("nccl"), num_kv_blocks=64)
        )
        trainer_model = _trainer_model(new)
        client = RayVLLMWeightSyncClient(actor)
        init_info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, timeout_s=TIMEOUT_S)
        engine = WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=ModuleSource(trainer_model))
        engine.send_weights()
        engine.shutdown()
        client.start_weight_update()  # an empty update, to set a version the way vLLM's Ray client does
        client.finish_weight_update(weight_version="v1")
        client.shutdown_weight_transfer_engine()
        assert compare_checksums(_checksums(trainer_model), ray.get(actor.weight_checksums.remote()))["match"]
        assert ray.get(actor.get_weight_version.remote()) == "v1"
        ray.get(actor.shutdown.remote())
    finally:
        ray.shutdown()
