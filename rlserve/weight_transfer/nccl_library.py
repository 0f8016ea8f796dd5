"""A ctypes binding of the few NCCL calls a weight-transfer group needs (nccl.h's public API), and `ncclUniqueId`.

vLLM's groups are raw NCCL communicators (`ncclCommInitRank` from a unique id), not torch `ProcessGroupNCCL`s, whose
own unique-id exchange goes through store keys of torch's: joining a vLLM group takes NCCL itself.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import torch

NCCL_UNIQUE_ID_BYTES = 128
NCCL_LIBRARY_ENV = "RLSERVE_NCCL_SO_PATH"

_NCCL_SUCCESS = 0
_NCCL_SUM = 0  # ncclRedOp_t: ncclSum
# ncclDataType_t, from nccl.h
_NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}

ncclComm_t = ctypes.c_void_p
cudaStream_t = ctypes.c_void_p


class ncclUniqueId(ctypes.Structure):  # noqa: N801 (NCCL's and vLLM's name)
    """NCCL's `ncclUniqueId`: 128 opaque bytes, minted by rank 0, that every rank passes to `ncclCommInitRank`."""

    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


def unique_id_from_bytes(data: bytes) -> ncclUniqueId:
    if len(data) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"expected a {NCCL_UNIQUE_ID_BYTES}-byte NCCL unique id, got {len(data)} bytes")
    unique_id = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(unique_id), data, NCCL_UNIQUE_ID_BYTES)
    return unique_id


def find_nccl_library() -> str:
    """`$RLSERVE_NCCL_SO_PATH`, else the `nvidia-nccl` wheel torch depends on, else the loader's `libnccl.so.2`."""
    configured = os.environ.get(NCCL_LIBRARY_ENV)
    if configured:
        return configured
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return "libnccl.so.2"


# NCCL 2.29.7 (encoded as ncclGetVersion reports it) brought NCCL_NO_CACHE.
_NCCL_NO_CACHE_VERSION = 22907


def has_nccl_no_cache() -> bool:
    """Whether the NCCL this process would load honours NCCL_NO_CACHE (NCCL >= 2.29.7); False without CUDA or a
    loadable NCCL. vLLM 0.33's `vllm.utils.nccl._nccl_has_no_cache`, which its tests skip on."""
    if torch.version.cuda is None:
        return False
    try:
        return NCCLLibrary().version() >= _NCCL_NO_CACHE_VERSION
    except (OSError, RuntimeError):
        return False


class NCCLLibrary:
    """The loaded library; each call raises RuntimeError with NCCL's message on failure."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or find_nccl_library()
        lib = ctypes.CDLL(self.path)
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(ncclUniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ncclComm_t), ctypes.c_int, ncclUniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t,
        ]  # fmt: skip
        lib.ncclBroadcast.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ncclComm_t, cudaStream_t,
        ]  # fmt: skip
        lib.ncclCommAbort.argtypes = [ncclComm_t]
        for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclBroadcast",
                     "ncclCommAbort"):  # fmt: skip
            getattr(lib, name).restype = ctypes.c_int
        self._lib = lib

    def _check(self, call: str, result: int) -> None:
        if result != _NCCL_SUCCESS:
            raise RuntimeError(f"{call} failed: {self._lib.ncclGetErrorString(result).decode()} (ncclResult {result})")

    def version(self) -> int:
        version = ctypes.c_int()
        self._check("ncclGetVersion", self._lib.ncclGetVersion(ctypes.byref(version)))
        return version.value

    def get_unique_id(self) -> ncclUniqueId:
        unique_id = ncclUniqueId()
        self._check("ncclGetUniqueId", self._lib.ncclGetUniqueId(ctypes.byref(unique_id)))
        return unique_id

    def comm_init_rank(self, world_size: int, unique_id: ncclUniqueId, rank: int) -> ncclComm_t:
        comm = ncclComm_t()
        self._check("ncclCommInitRank", self._lib.ncclCommInitRank(ctypes.byref(comm), world_size, unique_id, rank))
        return comm

    def all_reduce_sum(self, tensor: torch.Tensor, comm: ncclComm_t, stream: torch.cuda.Stream) -> None:
        """In place."""
        if tensor.dtype not in _NCCL_DTYPES:
            raise ValueError(f"NCCL cannot sum {tensor.dtype} tensors")
        pointer = ctypes.c_void_p(tensor.data_ptr())
        self._check(
            "ncclAllReduce",
            self._lib.ncclAllReduce(
                pointer, pointer, tensor.numel(), _NCCL_DTYPES[tensor.dtype], _NCCL_SUM, comm, stream.cuda_stream
            ),
        )

    def broadcast(self, tensor: torch.Tensor, root: int, comm: ncclComm_t, stream: torch.cuda.Stream) -> None:
        """In place: the root's tensor is sent, every other rank's overwritten. A dtype NCCL has no type for (fp8,
        wide unsigned ints) travels as its bytes: a broadcast copies bytes, whatever the type."""
        if tensor.dtype not in _NCCL_DTYPES:
            tensor = tensor.view(torch.uint8)
        pointer = ctypes.c_void_p(tensor.data_ptr())
        self._check(
            "ncclBroadcast",
            self._lib.ncclBroadcast(
                pointer, pointer, tensor.numel(), _NCCL_DTYPES[tensor.dtype], root, comm, stream.cuda_stream
            ),
        )

    def comm_abort(self, comm: ncclComm_t) -> None:
        self._check("ncclCommAbort", self._lib.ncclCommAbort(comm))
