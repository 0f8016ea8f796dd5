"""The served weights: their version, the tensors that hold no valid weights, a trainer's updates through a
weight-transfer engine (start, update, finish, abandon), writes from the front end or a directory, reloads, and
checksums. vLLM's engine-side worker methods that touch them (update_config, reload_weights, reset_weights) are here
too: collective_rpc (worker_rpc.py) runs them on the core, which keeps this bookkeeping right."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from rlserve.config import WeightTransferConfig
from rlserve.dtypes import dtype_from_name
from rlserve.engine.core.data_plane import DataPlane
from rlserve.engine.core.pause import PauseControl
from rlserve.engine.wire.call_policy import confined_weight_dir
from rlserve.outputs import DEFAULT_WEIGHT_VERSION
from rlserve.weight_transfer.base import TRAINER_LOST, WeightUpdateRefused

logger = logging.getLogger(__name__)

# What update_config may change: (vLLM's config name, its field) -> the EngineConfig field.
UPDATABLE_CONFIG = {("load_config", "load_format"): "load_format"}


class WeightControl:
    def __init__(self, plane: DataPlane, pausing: PauseControl) -> None:
        self.plane = plane
        self.pausing = pausing  # an abandoned update lifts the pause its trainer would have lifted
        self.version = DEFAULT_WEIGHT_VERSION
        self.transfer = None  # created by init_weight_transfer_engine
        self._transfer_backend: str | None = None  # its backend's name
        self.update_active = False
        # Checkpoint tensors that hold no valid weights: released by sleep(level=2), partly written by a failed
        # update_weights, or left from another version by an abandoned update. While any is, nothing is scheduled,
        # new requests are refused (`not_serving`) and finish_weight_update refuses, until writes cover them all.
        self.unwritten: set[str] = set()
        self._unwritten_since = ""  # what made them so, for the error messages
        self._update_written: set[str] = set()  # what the update in progress has written so far
        self._snapshot: dict[str, torch.Tensor] | None = None  # weight_update_snapshot's buffers, kept for reuse
        self._snapshot_valid = False  # they hold the weights of the update in progress's start

    # ---- what is served ----

    def not_serving(self) -> str | None:
        """Why generation is refused (new requests end with this error, requests in flight wait), or None."""
        if not self.unwritten:
            return None
        missing, total = len(self.unwritten), len(self.plane.runner.weight_names)
        example = sorted(self.unwritten)[0]
        return (
            f"the model's weights are incomplete ({self._unwritten_since}): {missing} of {total} tensors (e.g. "
            f"{example!r}) hold no valid weights; generation resumes once a weight update (start_weight_update, "
            "update_weights, finish_weight_update) or a reload (load_weights, update_weights with weight_dir) has "
            "written them"
        )

    def mark_unwritten(self, names: set[str], why: str) -> None:
        if names:
            if not self.unwritten:
                self._unwritten_since = why
            self.unwritten |= names

    def _written(self, names: set[str]) -> None:
        self.unwritten -= names
        if self.update_active:
            self._update_written |= names

    def _require_resident(self, operation: str) -> None:
        if not self.plane.runner.weights_resident:
            raise RuntimeError(f"{operation}: the engine is asleep; call wake_up(tags=['weights']) first")

    def get_weight_version(self) -> str:
        return self.version

    def update_weight_version(self, version: str) -> None:
        self.version = str(version)

    def checksums(self) -> dict[str, str]:
        self.plane.drain()
        self._require_resident("weight checksums")
        from rlserve.weight_transfer.checksum import weight_checksums

        # The whole tensors (every rank's part put together): what a trainer, or an engine of another size, has.
        return weight_checksums(self.plane.runner.full_checkpoint_weights())

    # ---- a trainer's updates ----

    def init_weight_transfer_engine(self, init_info: dict, backend: str | None = None) -> None:
        """`backend`: the one a framework's route speaks (prime-rl's /init_broadcaster, say), used when the engine
        was started without a weight-transfer config; one started with another backend refuses it."""
        from rlserve.weight_transfer import WeightTransferEngineFactory

        config, runner = self.plane.config, self.plane.runner
        transfer_config = self._transfer_config(backend)
        tp_size = config.tensor_parallel_size
        index = config.data_parallel_rank * tp_size  # vLLM's: dp_rank * TP + tp_rank; this is tp_rank 0
        if self.transfer is not None and self._transfer_backend != transfer_config.backend:
            self.close_transfer()  # a framework route's backend replaces the previous one
        if self.transfer is None:
            self._transfer_backend = transfer_config.backend
            self.transfer = WeightTransferEngineFactory.create_engine(
                transfer_config,
                runner.device,
                index,
                config.weight_transfer_timeout_s,
                model=runner.model,
                model_config=config,
            )
        parsed = self.transfer.parse_init_info(init_info)
        # The other ranks start their rendezvous on threads of their own and answer at once; they join with this one.
        runner.call_followers(
            "init_weight_transfer", transfer_config, init_info, index, config.weight_transfer_timeout_s
        )
        self.transfer.init_transfer_engine(parsed)

    def _transfer_config(self, backend: str | None) -> WeightTransferConfig:
        configured = self.plane.config.weight_transfer_config
        if backend is None and configured is None:
            # The core cannot tell which front end its caller used: the fix for each, the HTTP one first.
            raise RuntimeError(
                "Weight transfer not configured: start `rlserve serve` with --weight-transfer-config "
                '\'{"backend":"nccl"}\' (over HTTP), or create the engine with '
                "weight_transfer_config=WeightTransferConfig() (in Python)"
            )
        if backend is None:
            return configured
        if configured is not None and configured.backend != backend:
            raise RuntimeError(
                f"this route speaks the {backend!r} weight transfer, but the engine was started with backend "
                f"{configured.backend!r} (--weight-transfer-config): start it without one, or with {backend!r}"
            )
        return WeightTransferConfig(backend=backend)

    def _require_transfer(self, operation: str):
        if self.transfer is None:
            raise RuntimeError(
                f"{operation}: the weight transfer engine is not initialized; call init_weight_transfer_engine first"
            )
        return self.transfer

    def start_weight_update(self) -> None:
        self.plane.drain()
        transfer = self._require_transfer("start_weight_update")
        self._require_resident("start_weight_update")
        if self.update_active:
            raise RuntimeError(
                "start_weight_update: a weight update is already in progress; finish it first, or abandon it "
                "(abandon_weight_update) if its trainer is gone"
            )
        # A copy of the weights before the first byte of the update is written; only of complete weights.
        self._snapshot_valid = self.plane.config.weight_update_snapshot and not self.unwritten
        if self._snapshot_valid:
            self._snapshot = self.plane.runner.snapshot_weights(self._snapshot)
        self._update_written.clear()
        transfer.start_weight_update()
        self.update_active = True

    def update_weights(self, update_info: dict) -> None:
        self.plane.drain()  # no step may run while weights are being written (the core steps between update calls)
        transfer = self._require_transfer("update_weights")
        if not self.update_active:
            raise RuntimeError("update_weights: no weight update in progress; call start_weight_update first")
        info = transfer.parse_update_info(update_info)
        runner = self.plane.runner
        with runner.on_device():
            try:
                metadata = zip(info.names, info.shapes, info.dtype_names, strict=True)
                runner.model.check_weights(
                    ((n, tuple(s), dtype_from_name(d)) for n, s, d in metadata), whole_update=True
                )
            except ValueError:
                # The trainer may already be sending: take its bytes and drop them (on every rank, which has
                # written nothing either) so it does not hang.
                with runner.mirrored("receive_weights", update_info, False):
                    transfer.discard_weights(info)
                raise
            touched: set[str] = set()  # what load_weights was handed: a write that failed may have done part

            def load(weights: list[tuple[str, torch.Tensor]]) -> None:
                touched.update(runner.checkpoint_names(name for name, _ in weights))
                runner.load_weights(weights)

            if transfer.receives_into_model():  # it writes the model itself: count every tensor it names
                touched.update(runner.checkpoint_names(info.names))
            self._receive(transfer, info, update_info, load, touched)
        if transfer.applies_deltas:  # patched, not rewritten: a tensor with no valid weights still has none
            self._update_written |= touched
        else:
            self._written(touched)

    def _receive(self, transfer, info, update_info: dict, load, touched: set[str]) -> None:
        """Receive an update's tensors on every rank (each keeps its part); a failure leaves the update open, or
        abandons it when the trainer is lost."""
        runner = self.plane.runner
        try:
            # Every tensor-parallel rank receives the same broadcast and keeps its part.
            with runner.mirrored("receive_weights", update_info, True):
                transfer.receive(info, load)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
        except WeightUpdateRefused as e:  # refused before writing: nothing changed, the update stays open
            raise ValueError(f"update_info: {e}") from e  # a builtin type: it crosses to the front end as is
        except TRAINER_LOST as e:
            self._update_written |= touched
            outcome = self._abandon(f"the trainer was lost during update_weights: {e}")
            self.close_transfer()  # the transport is broken; the next trainer inits a new one
            raise RuntimeError(
                f"update_weights: the trainer was lost during the transfer ({e}); the update was abandoned "
                f"({outcome}); a trainer can init_weight_transfer_engine and start a new update"
            ) from e
        except Exception:
            # The trainer is still there (a refused handle, a failed copy): the update stays open, and what was
            # handed to load_weights must be sent again. Nothing handed over, nothing changed.
            self._update_written |= touched
            self.mark_unwritten(touched, "an update_weights call failed part-way through writing them")
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.plane.drain()
        if not self.update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        reason = self.not_serving()
        if reason is not None:
            raise RuntimeError(f"finish_weight_update: {reason}; send them with update_weights first")
        self.update_active = False
        self._update_written.clear()
        if self.transfer is not None:
            self.transfer.finish_weight_update()
        # KV computed under the old weights must not be served to requests that start from now on.
        self.plane.kv_cache.reset_prefix_cache()
        if weight_version is not None:
            self.version = str(weight_version)

    def abandon_weight_update(self) -> str:
        """Give up the update in progress by hand (its trainer is gone between calls, or stuck); see `_abandon`.
        Returns what became of the weights."""
        self.plane.drain()
        if not self.update_active:
            raise RuntimeError("abandon_weight_update: no weight update in progress")
        return self._abandon("abandoned by hand")

    def _abandon(self, why: str) -> str:
        """End the update in progress without finishing it. Weights it wrote are rolled back to the snapshot taken at
        its start (weight_update_snapshot), else they are from two versions and generation is refused until a full
        update. The pause it ran under is lifted: the trainer that would resume is gone, and a pause nobody lifts
        would hold every request forever (without weights nothing runs anyway). Returns "restored", "incomplete" or
        "unchanged"."""
        self.update_active = False
        written, self._update_written = self._update_written, set()
        if not written:
            outcome = "unchanged"
        elif self._snapshot_valid:
            self.plane.runner.restore_weights(self._snapshot)
            self.unwritten.clear()  # the snapshot is of complete weights: a failed call's went back too
            outcome = "restored"
        else:
            self.mark_unwritten(set(self.plane.runner.weight_names), f"a weight update was abandoned: {why}")
            outcome = "incomplete"
        self._snapshot_valid = False
        self.plane.kv_cache.reset_prefix_cache()  # KV computed under weights that are no longer served
        self.pausing.resume()
        logger.warning("weight update abandoned (%s): weights %s", why, outcome)
        return outcome

    def shutdown_weight_transfer_engine(self) -> None:
        """vLLM's: close the trainer's transfer group (a later init_weight_transfer_engine opens a new one)."""
        if self.update_active:
            raise RuntimeError("shutdown_weight_transfer_engine: a weight update is in progress; finish it first")
        self.close_transfer()

    def close_transfer(self) -> None:
        if self.transfer is not None:
            with self.plane.runner.mirrored("close_weight_transfer"):
                self.transfer.shutdown()
            self.transfer = None

    # ---- writes from the front end, a directory, the checkpoint (vLLM's worker methods) ----

    def update_config(self, overrides: dict[str, Any]) -> None:
        """vLLM's worker update_config, for what rlserve's engine reads after its start: the load format, which
        vLLM's skip_loading_weights_in_engine_init example switches from "dummy" to "auto" before reload_weights.
        Any other field is refused by name."""
        if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
            raise ValueError(f"overrides: expected {{config name: {{field: value}}}}, got {overrides!r}")
        changes: dict[str, Any] = {}
        for section, values in overrides.items():
            for name, value in values.items():
                if (section, name) not in UPDATABLE_CONFIG:
                    raise ValueError(
                        f"overrides: {section}.{name} cannot be updated on a running engine; supported: "
                        f"{[f'{s}.{n}' for s, n in UPDATABLE_CONFIG]}"
                    )
                changes[UPDATABLE_CONFIG[section, name]] = value
        try:
            config = replace(self.plane.config, **changes)  # checked as at start
        except ValueError as e:
            raise ValueError(f"overrides: {e}") from e
        self.plane.config = self.plane.runner.config = config

    def reload_weights(
        self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        """vLLM's worker reload_weights: write `weights_iterator` (checkpoint names; a core in the caller's process
        only), else read the checkpoint in `weights_path`, else the model's own directory, in place. Every tensor is
        checked before any is written, and the prefix cache is emptied."""
        if is_checkpoint_format is not True:
            raise ValueError(
                f"is_checkpoint_format: rlserve loads checkpoint-format names only, got {is_checkpoint_format!r}"
            )
        if weights_iterator is not None:
            self.load_weights_direct(weights_iterator)
            return
        config = self.plane.config
        if config.load_format == "dummy":
            raise ValueError(
                "load_format: the engine's load format is 'dummy', which reads no checkpoint; switch it first with "
                "collective_rpc('update_config', args=({'load_config': {'load_format': 'auto'}},))"
            )
        if weights_path is None:  # the served model's own directory, whatever the allowed ones
            self._load_checkpoint_dir(config.model, "weights_path")
        else:
            self.load_weights_from_dir(weights_path, "weights_path")

    def reset_weights(self) -> None:
        """vLLM's weight-checker reset: every weight zeroed, to check that the next update writes them all. rlserve
        refuses generation (not_serving) until writes cover them again, rather than serve from zeros."""
        self._require_resident("reset_weights")
        runner = self.plane.runner
        with runner.on_device():
            for _, tensor in runner.model.checkpoint_weights():
                tensor.zero_()
        self.mark_unwritten(set(runner.weight_names), "the weight checker's reset zeroed them")
        self.plane.kv_cache.reset_prefix_cache()

    def load_weights_direct(self, weights, reset_prefix_cache: bool = True) -> int:
        """Write checkpoint-format tensors straight into the model. `reset_prefix_cache=False` keeps KV computed
        under the old weights servable (only a tool that demonstrates stale KV wants that)."""
        self.plane.drain()
        self._require_resident("load_weights")
        weights = list(weights)
        runner = self.plane.runner
        written = runner.load_weights_on_all_ranks(weights)  # checks every tensor before writing any
        self._written(runner.checkpoint_names(name for name, _ in weights))
        if reset_prefix_cache:
            self.plane.kv_cache.reset_prefix_cache()
        return written

    def load_weights_from_dir(self, weight_dir: str, param: str = "weight_dir") -> int:
        """prime-rl's checkpoint-directory update: the safetensors files the trainer wrote to `weight_dir` (which
        the API server has checked against the operator's allowed directories), read here rather than shipped
        through the front end, and written through `load_weights_direct`: every tensor is checked before any is
        written, so a refused directory changes nothing. With `allowed_weight_dirs` configured the core checks the
        directory too (the API server's check, again)."""
        allowed = self.plane.config.allowed_weight_dirs
        if allowed is not None:
            weight_dir = confined_weight_dir(weight_dir, allowed, param)
        return self._load_checkpoint_dir(weight_dir, param)

    def _load_checkpoint_dir(self, weight_dir: str, param: str) -> int:
        from rlserve.model.loader import iterate_checkpoint

        try:
            weights = list(iterate_checkpoint(weight_dir))
        except Exception as e:  # no safetensors there, a truncated file, ...
            raise ValueError(f"{param}: cannot read safetensors weights from {weight_dir!r}: {e}") from e
        try:
            return self.load_weights_direct(weights)
        except ValueError as e:  # the model's check names the tensor; the client sent the directory
            raise ValueError(f"{param}: {e}") from e
