"""A worker extension written for vLLM: it imports vllm at module level, as TRL's former `WeightSyncWorkerExtension`,
PipelineRL's and SkyRL's do, so an rlserve engine core loads it only with the vllm import surface installed."""

from __future__ import annotations

import vllm
from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
from vllm.distributed.utils import StatelessProcessGroup


class VllmImportingExtension:
    def vllm_classes(self) -> dict[str, str]:
        """What `vllm` resolved to in the process that runs this worker."""
        classes = {
            cls.__name__: f"{cls.__module__}.{cls.__qualname__}" for cls in (PyNcclCommunicator, StatelessProcessGroup)
        }
        return {"vllm.__version__": vllm.__version__, **classes}
