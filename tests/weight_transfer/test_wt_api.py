"""Parsing and validation, the backend registry, IPC handle encoding and checksums: no processes, no GPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rlserve.config import WeightTransferConfig
from rlserve.sampling_params import SamplingParams
from rlserve.weight_transfer import (
    IPCStagingBuffer,
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    WeightTransferEngine,
    WeightTransferEngineFactory,
    compare_checksums,
    tensor_sha256,
    weight_checksums,
)
from rlserve.weight_transfer.ipc_handles import decode_rebuild_args, encode_rebuild_args
from rlserve.weight_transfer.packed import TensorMeta

CPU = torch.device("cpu")


def _nccl() -> NCCLWeightTransferEngine:
    return NCCLWeightTransferEngine(WeightTransferConfig("nccl"), CPU)


def _ipc() -> IPCWeightTransferEngine:
    return IPCWeightTransferEngine(WeightTransferConfig("ipc"), CPU)


def _meta(**extra: object) -> dict[str, object]:
    return {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []], **extra}


# --- parsing -------------------------------------------------------------------------------------------------------


def test_nccl_init_info_parses_g1_and_g3_shapes() -> None:
    g1 = _nccl().parse_init_info({"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2})
    assert g1 == NCCLWeightTransferInitInfo(master_address="127.0.0.1", master_port=29500, world_size=2, rank_offset=1)
    g3 = _nccl().parse_init_info(
        {
            "master_address": "h",
            "master_port": 1,
            "world_size": 3,
            "rank_offset": 1,
            "packed": True,
            "packed_buffer_size_bytes": 1 << 20,
            "packed_num_buffers": 3,
        }
    )
    assert g3.packed and g3.packed_buffer_size_bytes == 1 << 20 and g3.packed_num_buffers == 3


@pytest.mark.parametrize(
    "init_info",
    [
        {"master_address": "h", "master_port": 1, "world_size": 2, "unknown_key": 1},
        {"master_address": "h", "master_port": 1},
        {"master_address": "h", "master_port": "29500", "world_size": 2},
        {"master_address": "h", "master_port": 1, "world_size": 2, "rank_offset": 2},
        {"master_address": "h", "master_port": 1, "world_size": 1},
    ],
    ids=["unknown-key", "missing-key", "port-as-text", "rank-offset-out-of-range", "world-size-1"],
)
def test_invalid_init_info(init_info: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="Invalid init_info for NCCLWeightTransferEngine"):
        _nccl().parse_init_info(init_info)


def test_ipc_init_info_is_empty() -> None:
    _ipc().parse_init_info({})
    with pytest.raises(ValueError, match="Invalid init_info for IPCWeightTransferEngine"):
        _ipc().parse_init_info({"master_port": 1})


def test_update_info_validates_lengths_dtypes_and_shapes() -> None:
    engine = _nccl()
    info = engine.parse_update_info(_meta(packed=True))
    assert info.dtypes == [torch.bfloat16, torch.float32] and info.packed
    assert info.packed_buffer_size_bytes is None  # None: the init info's value applies
    assert engine.parse_update_info({"names": [], "dtype_names": [], "shapes": []}).names == []
    with pytest.raises(ValueError, match="`dtype_names` should be of the same size as `names`"):
        engine.parse_update_info(_meta(dtype_names=["float32"]))
    with pytest.raises(ValueError, match="`shapes` should be of the same size as `names`"):
        engine.parse_update_info(_meta(shapes=[[1]]))
    with pytest.raises(ValueError, match="not a torch dtype name"):
        engine.parse_update_info(_meta(dtype_names=["bfloat17", "float32"]))
    with pytest.raises(ValueError, match="not a torch dtype name"):
        engine.parse_update_info(_meta(dtype_names=["Tensor", "float32"]))
    with pytest.raises(ValueError, match="non-negative ints"):
        engine.parse_update_info(_meta(shapes=[[2, -1], []]))
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.parse_update_info(["not", "a", "dict"])  # type: ignore[arg-type]


def test_receive_before_init_is_refused() -> None:
    engine = _nccl()
    info = engine.parse_update_info(_meta())
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.receive_weights(info, lambda _: None)
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.discard_weights(info)
    engine.shutdown()


# --- factory -------------------------------------------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> type[WeightTransferEngineFactory]:
    """The factory with a private copy of the registry, so registrations do not leak into other tests."""
    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", dict(WeightTransferEngineFactory._registry))
    return WeightTransferEngineFactory


def test_factory_creates_builtin_engines() -> None:
    assert {"nccl", "ipc"} <= set(WeightTransferEngineFactory.available_engines())
    nccl = WeightTransferEngineFactory.create_engine(WeightTransferConfig("nccl"), CPU)
    ipc = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="ipc"), "cpu")
    assert isinstance(nccl, NCCLWeightTransferEngine) and nccl.device == CPU
    assert isinstance(ipc, IPCWeightTransferEngine)


def test_factory_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: nope\. Available engines: \[.*'nccl'"):
        WeightTransferEngineFactory.create_engine(WeightTransferConfig("nope"), CPU)


def test_factory_rejects_duplicates(registry: type[WeightTransferEngineFactory]) -> None:
    with pytest.raises(ValueError, match="Weight transfer engine 'nccl' is already registered"):
        registry.register_engine("nccl", NCCLWeightTransferEngine)


def test_factory_lazy_and_direct_registration(registry: type[WeightTransferEngineFactory]) -> None:
    registry.register_engine("colon", "rlserve.weight_transfer.ipc:IPCWeightTransferEngine")
    registry.register_engine("pair", "rlserve.weight_transfer.nccl", "NCCLWeightTransferEngine")
    registry.register_engine("direct", IPCWeightTransferEngine)
    registry.register_engine("missing", "rlserve.weight_transfer.no_such_module:Engine")
    assert registry.get_engine_cls("colon") is IPCWeightTransferEngine
    assert isinstance(registry.create_engine(WeightTransferConfig("pair"), CPU), NCCLWeightTransferEngine)
    assert registry.get_engine_cls("direct") is IPCWeightTransferEngine
    with pytest.raises(ModuleNotFoundError):  # lazy: the bad path only fails when used
        registry.get_engine_cls("missing")
    with pytest.raises(ValueError, match="needs a class"):
        registry.register_engine("no-class", "rlserve.weight_transfer.ipc")
    registry.register_engine("not-an-engine", "rlserve.weight_transfer.base:WeightTransferInitInfo")
    with pytest.raises(TypeError, match="not a WeightTransferEngine subclass"):
        registry.get_engine_cls("not-an-engine")


def test_base_engine_has_no_trainer_sender() -> None:
    with pytest.raises(NotImplementedError):
        WeightTransferEngine.trainer_send_weights(iter([]), {})


# --- IPC handles -----------------------------------------------------------------------------------------------------


def _fake_rebuild_args(dtype: torch.dtype = torch.bfloat16) -> tuple[object, ...]:
    """What reduce_tensor(t)[1] returns for a CUDA tensor (the bytes are opaque CUDA handles)."""
    return (
        torch.nn.Parameter,
        torch.Size([4, 8]),
        (8, 1),
        16,
        torch.storage.TypedStorage,
        dtype,
        3,
        b"\x00\xffcuda-ipc-mem-handle\x01",
        4096,
        512,
        False,
        b"/torch_123_ref_counter",
        7,
        b"\x10event",
        True,
    )


def test_ipc_handle_encoding_is_plain_json_and_round_trips() -> None:
    args = _fake_rebuild_args()
    encoded = encode_rebuild_args(args)
    text = json.dumps({"uuid": encoded})  # no custom encoder needed
    decoded = decode_rebuild_args(json.loads(text)["uuid"])
    assert decoded == list(args)
    assert decoded[0] is torch.nn.Parameter and decoded[4] is torch.storage.TypedStorage
    assert isinstance(decoded[1], torch.Size) and decoded[5] is torch.bfloat16
    assert encoded[6] == 3  # the storage device stays at index 6, as in vLLM's handles
    assert decode_rebuild_args(args) == list(args)  # raw arguments (in-process callers) are accepted too


@pytest.mark.parametrize(
    ("index", "value", "field"),
    [
        (0, "os.system", "tensor_cls"),
        (4, "builtins.eval", "storage_cls"),
        (5, "Tensor", "dtype"),
        (3, 1.5, "tensor_offset"),
        (7, "not base64!", "storage_handle"),
        (10, 1, "requires_grad"),
    ],
)
def test_ipc_handle_decoding_refuses_bad_fields(index: int, value: object, field: str) -> None:
    encoded = encode_rebuild_args(_fake_rebuild_args())
    encoded[index] = value
    with pytest.raises(ValueError, match=f"bad IPC handle field '{field}'"):
        decode_rebuild_args(encoded)


def test_ipc_update_info_refuses_pickled_handles() -> None:
    with pytest.raises(ValueError, match="never unpickles") as excinfo:
        _ipc().parse_update_info(_meta(ipc_handles_pickled="gASVAAAAAAAAAA=="))
    assert "ipc_handles" in str(excinfo.value)


def test_ipc_update_info_validation() -> None:
    handle = {"GPU-uuid": encode_rebuild_args(_fake_rebuild_args())}
    engine = _ipc()
    unpacked = engine.parse_update_info(_meta(ipc_handles=[handle, handle]))
    assert not unpacked.packed
    sizes = [12, 4]
    packed = engine.parse_update_info(_meta(ipc_handles=handle, tensor_sizes=sizes))
    assert packed.packed and packed.is_last_chunk  # a single dict is a packed buffer
    with pytest.raises(ValueError, match="`ipc_handles` must be provided"):
        engine.parse_update_info(_meta())
    with pytest.raises(ValueError, match="same size as `names`"):
        engine.parse_update_info(_meta(ipc_handles=[handle]))
    with pytest.raises(ValueError, match="tensor_sizes"):
        engine.parse_update_info(_meta(ipc_handles=handle, packed=True))
    with pytest.raises(ValueError, match="do not match"):
        engine.parse_update_info(_meta(ipc_handles=handle, tensor_sizes=[12, 8]))
    with pytest.raises(ValueError, match="not allowed"):
        engine.parse_update_info(_meta(ipc_handles=[handle, {"GPU-uuid": ["os.system", *handle["GPU-uuid"][1:]]}]))
    kept = engine.parse_update_info(_meta(ipc_handles=handle, tensor_sizes=sizes, keep_mapped=True))
    assert kept.keep_mapped and not packed.keep_mapped
    with pytest.raises(ValueError, match="`keep_mapped` needs a packed update"):
        engine.parse_update_info(_meta(ipc_handles=[handle, handle], keep_mapped=True))
    with pytest.raises(ValueError, match="`keep_mapped` must be a bool"):
        engine.parse_update_info(_meta(ipc_handles=handle, tensor_sizes=sizes, keep_mapped="yes"))


def test_ipc_staging_buffer_arguments_are_checked() -> None:
    staging = IPCStagingBuffer(1024)
    assert staging.buffer is None  # allocated (and exported) on the first tensor sent, on its device
    kept = IPCTrainerSendWeightsArgs(send_mode=lambda info: None, packed=True, staging=staging)
    assert kept.staging is staging
    with pytest.raises(ValueError, match="needs packed=True"):
        IPCTrainerSendWeightsArgs(send_mode=lambda info: None, staging=staging)
    with pytest.raises(ValueError, match="differs from the staging buffer's size"):
        IPCTrainerSendWeightsArgs(
            send_mode=lambda info: None, packed=True, packed_buffer_size_bytes=512, staging=staging
        )
    with pytest.raises(ValueError, match="must be an IPCStagingBuffer"):
        IPCTrainerSendWeightsArgs(send_mode=lambda info: None, packed=True, staging=1024)
    with pytest.raises(ValueError, match=">= 1 byte"):
        IPCStagingBuffer(0)


def test_ipc_engine_needs_cuda() -> None:
    engine = _ipc()
    handle = {"GPU-uuid": encode_rebuild_args(_fake_rebuild_args())}
    with pytest.raises(RuntimeError, match="CUDA device"):
        engine.init_transfer_engine(engine.parse_init_info({}))
    with pytest.raises(RuntimeError, match="CUDA device"):
        engine.receive_weights(engine.parse_update_info(_meta(ipc_handles=[handle, handle])), lambda _: None)
    engine.shutdown()


def test_rebuild_cuda_tensor_signature_matches_the_encoding() -> None:
    # The positional encoding mirrors rebuild_cuda_tensor's parameters; catch a torch that reorders them.
    names = rebuild_cuda_tensor.__code__.co_varnames[: rebuild_cuda_tensor.__code__.co_argcount]
    assert names[6] == "storage_device" and len(names) == len(_fake_rebuild_args())


# --- checksums -----------------------------------------------------------------------------------------------------


def test_checksums() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_sha256(a) == tensor_sha256(a.clone()) == tensor_sha256(a.t().contiguous().t())
    assert tensor_sha256(a) != tensor_sha256(a.reshape(3, 2))  # same bytes, another shape
    assert tensor_sha256(a) != tensor_sha256(a.view(torch.int32))  # same bytes, another dtype
    bf16 = torch.randn(5, dtype=torch.bfloat16)
    bumped = bf16.clone()
    bumped.view(torch.int16)[0] += 1  # one ulp
    assert tensor_sha256(bf16) != tensor_sha256(bumped)
    assert tensor_sha256(torch.tensor(1.0)) != tensor_sha256(torch.tensor([1.0]))

    expected = weight_checksums([("a", a), ("b", bf16), ("c", a)])
    actual = weight_checksums([("a", a), ("b", bumped), ("d", a)])
    assert compare_checksums(expected, expected) == {"match": True, "mismatches": [], "missing": [], "unexpected": []}
    assert compare_checksums(expected, actual) == {
        "match": False,
        "mismatches": ["b"],
        "missing": ["c"],
        "unexpected": ["d"],
    }


def test_backends_are_loaded_inside_the_core_process(qwen3_dir, make_llm, monkeypatch):
    """The core runs in its own process: a backend named by import path loads there; one registered here by a class
    it cannot import (defined in a function) is refused with the fix named, and the engine keeps serving."""
    ipc_by_path = WeightTransferConfig("rlserve.weight_transfer.ipc:IPCWeightTransferEngine")
    by_path = make_llm(qwen3_dir, weight_transfer_config=ipc_by_path)
    with pytest.raises(RuntimeError, match="CUDA"):  # the ipc backend itself refuses a CPU engine at the handshake
        by_path.init_weight_transfer_engine({"init_info": {}})
    by_path.shutdown()

    class LocalEngine(IPCWeightTransferEngine):
        pass

    monkeypatch.setattr(WeightTransferEngineFactory, "_registry", dict(WeightTransferEngineFactory._registry))
    WeightTransferEngineFactory.register_engine("local-only", LocalEngine)
    llm = make_llm(qwen3_dir, weight_transfer_config=WeightTransferConfig("local-only"))
    with pytest.raises(ValueError, match="package.module:Class"):
        llm.init_weight_transfer_engine({"init_info": {}})
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


def test_ipc_staging_buffer_fills_a_known_layout_through_cached_views() -> None:
    """A kept staging buffer's second sync of a layout copies through typed views made once; the bytes are those of
    the first (byte views and a cat), and an unaligned layout keeps to the cat. The engine's side reads the chunk
    back through views it keeps per layout. CPU tensors stand in for CUDA ones (the export needs a GPU)."""
    from rlserve.weight_transfer.ipc import _Mapping

    staging = IPCStagingBuffer(1 << 12)
    staging.buffer = torch.zeros(1 << 12, dtype=torch.uint8)  # what on() allocates, without exporting it
    gen = torch.Generator().manual_seed(0)
    chunk = [("a", torch.randn(3, 4, generator=gen).to(torch.bfloat16)), ("b", torch.randn(7, generator=gen))]
    fields = staging.fill(chunk)
    first = staging.buffer.clone()
    assert fields["names"] == ["a", "b"] and fields["tensor_sizes"] == [24, 28]
    staging.buffer.zero_()
    assert staging.fill(chunk) == fields
    assert torch.equal(staging.buffer, first)  # the second fill went through the cached views
    assert staging._layouts[tuple(staging._layouts)[0]].views  # and they exist
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in chunk]
    mapping = _Mapping(("export",), staging.buffer, {})
    for _ in range(2):  # made once, then reused
        received = mapping.tensors(metas)
        assert [n for n, _ in received] == ["a", "b"]
        assert all(torch.equal(r, t) for (_, r), (_, t) in zip(received, chunk, strict=True))
    assert len(mapping.views) == 1
    odd = [("c", torch.ones(3, dtype=torch.uint8)), ("d", torch.full((2,), 2.0))]  # d at byte 3: no float view
    for _ in range(2):
        staging.fill(odd)
        assert staging.buffer[:3].tolist() == [1, 1, 1]
        assert torch.equal(staging.buffer[3:11].clone().view(torch.float32), torch.full((2,), 2.0))
