"""SkyRL's worker extension, `NewInferenceWorkerWrap`, as `rlserve serve --worker-extension-cls
skyrl_extension:SkyRLWorkerExtension` loads it in the tests (with RLSERVE_VLLM_SURFACE=1: it imports vllm). The skyrl
found first on sys.path is used: SkyRL's source at a commit, put there by the test, or the installed release.

Two things stand between SkyRL's class and a CPU-only test machine, and this module handles exactly those:
- skyrl's package `__init__`s import far more than the extension: its packages are loaded bare
  (framework_imports.py), as the tests load skyrl's client modules;
- SkyRL's `update_weights_nccl` ends with `torch.accelerator.synchronize()`, which raises on a machine without an
  accelerator (torch 2.13) where there is nothing to wait for: the subclass runs SkyRL's method with that call a no-op
  when `torch.accelerator.is_available()` is false. Every other line is SkyRL's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from framework_imports import skyrl_module

_wrap = skyrl_module("skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap")


@contextmanager
def _accelerator_sync_on_cpu() -> Iterator[None]:
    if torch.accelerator.is_available():
        yield
        return
    with mock.patch.object(torch.accelerator, "synchronize", lambda device=None: None):
        yield


class SkyRLWorkerExtension(_wrap.NewInferenceWorkerWrap):
    def update_weights_nccl(self, update_info: dict) -> None:
        with _accelerator_sync_on_cpu():
            super().update_weights_nccl(update_info)
