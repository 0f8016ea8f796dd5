"""What a trainer sends, as vLLM 0.33 declares it: `WeightSource` (metadata plus iteration), `ParamMeta` (one
parameter's name, dtype, full shape and which trainer ranks own it in what layout) and `ModuleSource` (an
`nn.Module`'s parameters, plain or DTensor/FSDP-sharded).

A sharded parameter is gathered one tensor at a time while iterating (`DTensor.full_tensor()`, a collective among
its owners), so a trainer never holds more than one gathered parameter beyond its shards. A sharding scheme that is
not a DTensor plugs in through `ModuleSource(module, gather=...)`: called per parameter on every rank, it returns the
full tensor (and runs whatever collective that takes).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along this mesh axis holds the whole extent."""


@dataclass(frozen=True)
class Shard:
    """This mesh axis splits tensor dim `dim` as `torch.chunk` does."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    """One parameter: name, wire dtype, full shape; `owners` the trainer ranks holding it (None: every rank),
    `mesh_shape` their row-major mesh (default `(len(owners),)`), `placements` one `Shard`/`Replicate` per mesh axis
    (None: replicated). Identical on every trainer rank, so every rank plans the same transfer without exchanging
    it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(
                    f"parameter {self.name!r}: mesh_shape/placements given without owners (the ranks that hold it)"
                )
            return
        owners = tuple(self.owners)
        if not owners or any(type(r) is not int or r < 0 for r in owners) or len(set(owners)) != len(owners):
            raise ValueError(f"parameter {self.name!r}: owners must be distinct non-negative ranks, got {owners}")
        mesh_shape = tuple(self.mesh_shape) if self.mesh_shape is not None else (len(owners),)
        if any(d <= 0 for d in mesh_shape) or math.prod(mesh_shape) != len(owners):
            raise ValueError(f"parameter {self.name!r}: mesh_shape {mesh_shape} does not cover {len(owners)} owners")
        placements = self.placements
        if placements is not None:
            placements = tuple(placements)
            if len(placements) != len(mesh_shape):
                raise ValueError(
                    f"parameter {self.name!r}: {len(placements)} placements for a {len(mesh_shape)}-D mesh"
                )
            for p in placements:
                if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                    raise ValueError(f"parameter {self.name!r}: shards dim {p.dim} of a {len(self.shape)}-D tensor")
                if not isinstance(p, Shard | Replicate):
                    raise TypeError(f"parameter {self.name!r}: placement {p!r} is neither Replicate nor Shard")
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "placements", placements)


class WeightSource(ABC):
    """The trainer's weights: `metadata` declares every parameter on every rank (transferring nothing);
    `iter_full()` yields each parameter this rank owns as a full tensor, in metadata order, gathering as it goes
    (every owner iterates, so the gathers line up). Each call starts a fresh pass."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property: engines read it repeatedly")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter, identical on every rank (a `cached_property`)."""

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def implements_iter_local(self) -> bool:
        return type(self).iter_local is not WeightSource.iter_local

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


GatherFn = Callable[[str, torch.Tensor], torch.Tensor]
"""(name, this rank's parameter) -> the full tensor; called on every rank, in metadata order."""


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor (an all-gather among its mesh); any other tensor as it is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _dtensor_layout(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...] | None]:
    """(owners, mesh_shape, placements) of a DTensor; placements None when not plain Shard/Replicate (Partial,
    strided shards): declared replicated, gathered whole."""
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    grid = param.device_mesh.mesh  # type: ignore[attr-defined]
    owners, mesh_shape = tuple(grid.flatten().tolist()), tuple(grid.shape)
    placements: list[Placement] = []
    for p in param.placements:  # type: ignore[attr-defined]
        if type(p) is TorchShard:
            placements.append(Shard(p.dim))
        elif type(p) is TorchReplicate:
            placements.append(Replicate())
        else:
            return owners, mesh_shape, None
    return owners, mesh_shape, tuple(placements)


def _is_dtensor(param: torch.Tensor) -> bool:
    return getattr(param, "device_mesh", None) is not None


class ModuleSource(WeightSource):
    """`module.named_parameters()` as a `WeightSource`. A plain tensor is owned by every rank; a DTensor by its
    mesh's global ranks (which must be the trainer ranks of `TrainerInitInfo.rank`). `iter_full` gathers each
    DTensor with `full_tensor()`, or with `gather` for parameters sharded some other way (`gather` then sees every
    parameter and its metadata is the local tensor's unless `shapes` gives the full one). Shard the module before
    the first `metadata` read: it is cached."""

    def __init__(
        self, module: torch.nn.Module, gather: GatherFn | None = None, shapes: dict[str, tuple[int, ...]] | None = None
    ) -> None:
        self._module = module
        self._gather = gather
        self._shapes = shapes or {}

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for name, p in self._module.named_parameters():
            shape = tuple(self._shapes.get(name, p.shape))
            if not _is_dtensor(p):
                metas.append(ParamMeta(name, p.dtype, shape))
                continue
            owners, mesh_shape, placements = _dtensor_layout(p)
            metas.append(ParamMeta(name, p.dtype, shape, owners=owners, mesh_shape=mesh_shape, placements=placements))
        return metas

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            if _is_dtensor(param) and param.device_mesh.get_coordinate() is None:  # type: ignore[attr-defined]
                continue  # not on this rank's mesh: not an owner
            full = self._gather(name, param) if self._gather is not None else materialize_full_tensor(param)
            yield name, full.detach()

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._module.named_parameters():
            if not _is_dtensor(param):
                yield name, param.detach()
            elif param.device_mesh.get_coordinate() is not None:  # type: ignore[attr-defined]
                # A layout other than plain Shard/Replicate is declared replicated: gathered whole.
                plain = _dtensor_layout(param)[2] is not None
                yield name, (param.to_local() if plain else param.full_tensor()).detach()  # type: ignore[attr-defined]
