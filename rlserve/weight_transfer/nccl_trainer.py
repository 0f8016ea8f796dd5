"""The `nccl` backend's trainer side in vLLM 0.33's shape: `NCCLTrainerWeightTransferEngine`, built by
`WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...), client=..., source=...)`.

Its parts keep vLLM's names, so trainer code that extends or patches them (a subclass overriding
`_build_worker_init_payload` or `_open_trainer_endpoint`, a test replacing `open_trainer_endpoint`) works as on vLLM:
`model_update_group` is the trainer's end of the group (rlserve's `WeightTransferGroup`: gloo on CPU, NCCL on CUDA),
opened by the module-level `open_trainer_endpoint`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, Self

from rlserve.dtypes import dtype_name
from rlserve.weight_transfer.nccl import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    NCCLTrainerSendWeightsArgs,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    WeightTransferGroup,
)
from rlserve.weight_transfer.source import ParamMeta, WeightSource
from rlserve.weight_transfer.trainer import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    check_single_sender,
    checked_iter,
    run_trainer_rendezvous,
    send_with_update,
)


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    """The trainer's rendezvous: it serves the store at `master_address:master_port` as rank 0 of a group of
    `world_size` (trainer + every engine worker). `packed` and the buffer geometry are the wire parameters, handed to
    the engine at the handshake so the two sides cannot disagree (packed by default, as vLLM 0.33's trainer).
    `timeout_s` (rlserve's): how long the rendezvous and each broadcast wait for the engine."""

    backend: ClassVar[str] = "nccl"

    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S


class RendezvousInfo(Protocol):
    """What `open_trainer_endpoint` and `build_worker_init_payload` read of a trainer init info (vLLM's
    `NCCLRendezvous`): `master_address`, `master_port`, `world_size`, and rlserve's optional `timeout_s`."""

    master_address: str
    master_port: int
    world_size: int


def open_trainer_endpoint(init_info: RendezvousInfo) -> WeightTransferGroup:
    """The trainer's end of the group, as rank 0 (it serves the store). Blocks until every engine worker has joined,
    so the engine's `init_weight_transfer_engine` must be in flight (see `run_trainer_rendezvous`)."""
    timeout_s = getattr(init_info, "timeout_s", DEFAULT_TIMEOUT_S)
    return WeightTransferGroup.create(
        init_info.master_address, init_info.master_port, 0, init_info.world_size, timeout_s
    )


def build_worker_init_payload(
    init_info: RendezvousInfo,
    *,
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> dict[str, Any]:
    """The engine's init_info for a trainer's rendezvous: its workers take the ranks after the trainer's."""
    info = NCCLWeightTransferInitInfo(
        master_address=init_info.master_address, master_port=init_info.master_port, world_size=init_info.world_size,
        rank_offset=1, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes,
        packed_num_buffers=packed_num_buffers,
    )  # fmt: skip
    return {k: v for k, v in asdict(info).items() if v is not None}


class NCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine[NCCLTrainerInitInfo]):
    """Broadcasts the whole `WeightSource` from rank 0 every round, the engine's `update_weights` receiving
    concurrently; only a changed parameter set ships its metadata again. Non-sender ranks iterate the source only, to
    join the gathers of sharded parameters."""

    init_info_cls = NCCLTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        rank: int = 0,
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.packed = packed
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.model_update_group: WeightTransferGroup | None = None
        self._sent_meta: list[ParamMeta] | None = None  # the engine reuses metadata it already has

    @classmethod
    def _build_worker_init_payload(cls, init_info: NCCLTrainerInitInfo) -> dict[str, Any]:
        return build_worker_init_payload(
            init_info,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )

    def _open_trainer_endpoint(self, init_info: NCCLTrainerInitInfo) -> None:
        self.model_update_group = open_trainer_endpoint(init_info)

    @classmethod
    def trainer_init(
        cls, init_info: NCCLTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource (it sends full tensors)")
        if not source.implements_iter_full():
            raise TypeError(f"NCCL broadcast sends full tensors, but {type(source).__name__} has no iter_full()")
        check_single_sender(source)
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            rank=init_info.rank,
            packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers,
        )
        if engine.is_sender:
            payload = cls._build_worker_init_payload(init_info)
            run_trainer_rendezvous(
                init_worker=lambda: engine.client.init_weight_transfer_engine(payload),
                init_trainer=lambda: engine._open_trainer_endpoint(init_info),
            )
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata
        if not self.is_sender:
            for _ in self.source.iter_full():  # the gathers of sharded parameters need every owner
                pass
            return
        group = self.model_update_group
        if group is None:
            raise RuntimeError("send_weights before trainer_init() or after shutdown(): call trainer_init")
        update_info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": []}
        if meta != self._sent_meta:
            update_info = {
                "names": [m.name for m in meta],
                "dtype_names": [dtype_name(m.dtype) for m in meta],
                "shapes": [list(m.shape) for m in meta],
            }
        args = NCCLTrainerSendWeightsArgs(
            group=group, packed=self.packed, packed_buffer_size_bytes=self.packed_buffer_size_bytes,
            packed_num_buffers=self.packed_num_buffers,
        )  # fmt: skip
        self.client.start_weight_update()
        send_with_update(
            lambda: self.client.update_weights(update_info),
            lambda: NCCLWeightTransferEngine.trainer_send_weights(checked_iter(self.source, meta), args),
        )
        self.client.finish_weight_update()
        self._sent_meta = meta

    def shutdown(self) -> None:
        if self.model_update_group is not None:
            self.model_update_group.destroy()
            self.model_update_group = None
