"""Shared set-up of the CPU checks of Triton kernels, which run under Triton's interpreter (TRITON_INTERPRET=1).

Triton decides at import time whether its own library functions are interpreted, so TRITON_INTERPRET must be set
before the first `import triton`: a test module imports this one before anything that may import triton. When
something imported triton earlier in this process (tests/conftest.py's imports do), the checks run in a fresh Python
process instead (`run_in_fresh_process`), and this process is left untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# Decided before anything below can import triton.
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or "triton" not in sys.modules
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"

interpreted = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported before TRITON_INTERPRET was set; test_in_fresh_process runs these checks",
)


def _minor_version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def require_triton() -> None:
    """Skip the calling test module where Triton is missing or its interpreter cannot run with this numpy."""
    triton = pytest.importorskip("triton")
    if _minor_version(triton.__version__) < (3, 7) and _minor_version(np.__version__) >= (2, 4):
        pytest.skip(
            "Triton < 3.7's interpreter breaks on numpy >= 2.4 (triton-lang/triton#9171)", allow_module_level=True
        )


def run_in_fresh_process(test_file: str) -> None:
    """Run test_file's checks in a new Python process that sets TRITON_INTERPRET before importing triton."""
    root = Path(__file__).resolve().parents[3]
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "--noconftest"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def round_casts_like_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Triton's interpreter round fp32 -> bf16 and fp32 -> float8_e4m3fn casts to nearest even, as the GPU's cvt
    instructions (and PyTorch) do: it truncates to bf16, and to fp8 it rounds half up and drops the carry when a
    mantissa rounds up into the next power of two (126.4 becomes 64, not 128). Only then can a kernel's roundings be
    held to the reference's."""
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    gpu_casts = {
        tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
        tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8),
    }

    def round_to_nearest_even(data: np.ndarray, src, dst, rounding_mode) -> np.ndarray:
        if src == tl.float32 and dst in gpu_casts:
            dtype, bits, np_bits = gpu_casts[dst]
            rounded = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
            return rounded.view(bits).numpy().view(np_bits)
        return convert(data, src, dst, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", round_to_nearest_even)
