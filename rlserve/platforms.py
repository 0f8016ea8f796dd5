"""`vllm.platforms.current_platform` as rlserve has it: the device this process's engine (or trainer helper) runs on,
CUDA when torch sees a GPU, else the CPU. rlserve runs on no other accelerator, so the ROCm / TPU / XPU questions
frameworks ask of vLLM's platform answer False."""

from __future__ import annotations

import torch


class Platform:
    """The few questions RL frameworks and vLLM's tests ask of vLLM's platform object."""

    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    @property
    def dispatch_key(self) -> str:
        return "CUDA" if self.is_cuda() else "CPU"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_rocm(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_cuda() else 1

    def set_device(self, device: torch.device) -> None:
        """Make `device` the current one (CUDA); the CPU has only one."""
        device = torch.device(device)
        if device.type != self.device_type:
            raise ValueError(f"set_device: {device} is not a {self.device_type} device (rlserve's platform here)")
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def get_device_uuid(self, device_id: int = 0) -> str:
        if not self.is_cuda():
            raise RuntimeError("get_device_uuid: the CPU platform has no device UUID")
        return str(torch.cuda.get_device_properties(device_id).uuid)


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
