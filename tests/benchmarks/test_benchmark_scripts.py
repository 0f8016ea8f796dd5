"""Every script in benchmarks/ still runs, so that a refactor that breaks one fails here instead of in a GPU session:
each answers --help on a machine without a GPU (or Triton); each that can run on the CPU runs its smoke mode (a tiny
model, a few steps) to the end; the GPU-only ones say so and exit; every python command line in the gpu_*.sh scripts
parses with its script's own argparse (the scripts run with python3 and nvidia-smi replaced by recorders)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
PARSE_ONLY = Path(__file__).with_name("parse_only.py")
# The scripts (workloads.py is a module the scripts import, with no command line of its own).
PYTHON_SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
SHELL_SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("gpu_*.sh") if p.name != "gpu_lib.sh")  # gpu_lib is sourced

# script: (arguments of its CPU smoke mode, a line its output must contain)
SMOKE = {
    "output_processing.py": (["--batch", "8", "--steps", "4"], "us per"),
    "host_overhead.py": (
        ["--batch", "8", "--prompt-len", "8", "--output-len", "4", "--repeats", "1"],
        "host work per decode step",
    ),
    "throughput.py": (  # W1 and W1/inline with --repeats run in gpu_session.sh's smoke
        ["--device", "cpu", "--preset", "tiny", "--scale", "0.005", "--hf", "none", "--warmup", "short"]
        + ["--workloads", "W2,W3/sync"],
        "W3/sync",
    ),
    "roofline.py": (["--workloads", "W1,W2", "--scale", "0.01"], "W2:"),
    "fp8_update.py": (["--device", "cpu", "--preset", "tiny-fp8", "--repeats", "1"], "fbgemm_fp8:"),
    "moe_throughput.py": (
        ["--device", "cpu", "--preset", "tiny-moe", "--scale", "0.005", "--dtype", "float32", "--hf-batch", "0"],
        "W1 tiny-moe:",
    ),
    "parity.py": (
        ["--device", "cpu", "--preset", "tiny", "--num-prompts", "2", "--prompt-len", "8", "--max-tokens", "4"],
        "",
    ),
    "async_updates.py": (["--device", "cpu", "--preset", "tiny", "--scale", "0.005", "--every", "2"], "keep+clear"),
    "dp_pause_latency.py": (
        ["--device", "cpu", "--ranks", "1", "--sync-intervals", "1", "--repeats", "1"],
        "independent",
    ),
    "startup_time.py": (  # the timeline's line of the core, read from the server's log, comes after the result's
        [
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--max-tokens",
            "2",
            "--timeout",
            "120",
            "--serve-arg=--log-level=info",
        ],
        "rlserve-engine-core  start-up: forked from the fork server",
    ),
    "server_throughput.py": (
        ["--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--repeats", "1", "--client-processes", "1"]
        + ["--cpu-threads", "1"],
        "API server us/token",
    ),
    "w7_client_ceiling.py": (
        ["--num-prompts", "8", "--output-len", "4", "--repeats", "1", "--client-processes", "1"]
        + ["--server-processes", "1"],
        "| streaming     |",
    ),
    "prefix_attention.py": (  # the long workload's 128-token prompts group; W2's at this scale are too short to
        ["--device", "cpu", "--preset", "tiny", "--scale", "0.005", "--repeats", "1", "--long-prompts", "2"]
        + ["--long-prompt-len", "128", "--long-output-len", "8"],
        "| long |",
    ),
    "control_plane_load.py": (
        ["--clients", "8", "--client-processes", "1", "--cycles", "3", "--update-cycles", "1", "--kill-cycle", "2"]
        + ["--hold-s", "0.2"],
        "| verdict | PASS |",
    ),
}
# Smoke runs that start servers and engine processes: over the fast tests' few seconds.
SLOW_SMOKE = {
    "startup_time.py",
    "server_throughput.py",
    "w7_client_ceiling.py",
    "control_plane_load.py",
    "dp_pause_latency.py",
    "async_updates.py",
}
# Triton kernels, CUDA streams, cuBLASLt's FP8 GEMMs, the fused MoE phases under CUDA graphs
GPU_ONLY = {
    "attention_kernels.py",
    "batch_invariant_profile.py",
    "receive_overlap.py",
    "fp8_gemm.py",
    "moe_layer_profile.py",
}
# Run by another smoke: offline_generate.py, session_table.py and weight_sync.py (over gloo) by gpu_session.sh's,
# fp8_table.py by gpu_fp8.sh's,
# w7_clients.py by server_throughput.py's (its client processes); vllm_rl_tests.py (whose full run takes minutes) by
# test_vllm_rl_tests_classifies_a_fixture and, over one of vLLM's own files, by
# test_vllm_033_unique_id_tests_pass_on_rlserve.
COVERED_BY = {
    "offline_generate.py": "gpu_session.sh",
    "weight_sync.py": "gpu_session.sh",
    "session_table.py": "gpu_session.sh",
    "fp8_table.py": "gpu_fp8.sh",
    "w7_clients.py": "server_throughput.py",
    "vllm_rl_tests.py": "test_vllm_rl_tests_classifies_a_fixture",
}


def bench_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def parse_only(commands: list[list[str]]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(PARSE_ONLY)],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=bench_env(),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_script_has_a_smoke_or_says_why_not():
    assert sorted(set(SMOKE) | GPU_ONLY | set(COVERED_BY)) == PYTHON_SCRIPTS


@pytest.fixture(scope="module")
def shell_commands(tmp_path_factory) -> dict[str, list[list[str]]]:
    return {script: recorded_commands(script, tmp_path_factory.mktemp(script)) for script in SHELL_SCRIPTS}


@pytest.fixture(scope="module")
def parsed(shell_commands) -> dict[tuple[str, ...], dict]:
    """Every script's --help and every python command line of the gpu_*.sh scripts, parsed in one process."""
    commands = [[f"benchmarks/{s}", "--help"] for s in PYTHON_SCRIPTS]
    for script in SHELL_SCRIPTS:
        commands += parsed_commands(shell_commands[script])
    return {tuple(c): result for c, result in zip(commands, parse_only(commands), strict=True)}


@pytest.mark.parametrize("script", PYTHON_SCRIPTS)
def test_answers_help_without_a_gpu(parsed, script):
    result = parsed[(f"benchmarks/{script}", "--help")]
    assert result["ok"], result["output"][-3000:]
    assert "usage:" in result["output"]


def run_script(command: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=bench_env(**env),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SMOKE else s for s in sorted(SMOKE)]
)
def test_cpu_smoke_mode_runs(script):
    args, expected = SMOKE[script]
    done = run_script([sys.executable, f"benchmarks/{script}", *args])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert expected in done.stdout, output[-4000:]


@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_gpu_only_scripts_say_so(script):
    done = run_script([sys.executable, f"benchmarks/{script}"], timeout=120)
    assert done.returncode != 0
    assert "CUDA" in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


RECORDER = """#!/usr/bin/env bash
# Records its command line (NUL-separated, one file per call) and succeeds, printing one line (for the pipelines
# that filter a part's output, which fail on none under pipefail).
printf '%s\\0' "$@" >"$CALLS/$(date +%s%N)-$$"
echo "recorded"
"""
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# Two GPUs for -L (the two-GPU parts run too), nothing for queries: no processes on the GPU.
[ "${1:-}" = "-L" ] && printf 'GPU 0: NVIDIA H200\\nGPU 1: NVIDIA H200\\n'
exit 0
"""


def recorded_commands(script: str, tmp_path: Path) -> list[list[str]]:
    """The python3 command lines `bash benchmarks/SCRIPT` runs, with python3 and nvidia-smi replaced."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.mkdir()
    for name, text in (("python3", RECORDER), ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    done = run_script(
        ["bash", f"benchmarks/{script}"],
        timeout=120,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        CALLS=str(calls),
        OUT=str(out),
        LOGS=str(logs),
    )
    assert done.returncode == 0, f"{script}: " + (done.stdout + done.stderr)[-3000:]
    return [path.read_text().split("\0")[:-1] for path in sorted(calls.iterdir())]


def pytest_paths(command: list[str]) -> list[str]:
    args, paths = command[2:], []
    for i, arg in enumerate(args):
        if not arg.startswith("-") and (i == 0 or args[i - 1] != "-p"):
            paths.append(arg)
    return paths


@pytest.mark.parametrize("script", SHELL_SCRIPTS + ["gpu_lib.sh"])
def test_shell_script_syntax(script):
    done = subprocess.run(["bash", "-n", str(BENCHMARKS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def parsed_commands(commands: list[list[str]]) -> list[list[str]]:
    """The command lines a script's argparse reads (not `-c` code, a heredoc on stdin, pip or pytest)."""
    return [c for c in commands if c and c[0] not in ("-c", "-") and c[:2] not in (["-m", "pip"], ["-m", "pytest"])]


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_python_commands_parse(shell_commands, parsed, script):
    # PROFILE=1 reaches gpu_server.sh's py-spy parts only where py-spy is installed: not asked for here.
    commands = shell_commands[script]
    assert parsed_commands(commands), f"{script} ran no python command"
    for command in commands:
        if command[:2] == ["-m", "pytest"]:
            missing = [p for p in pytest_paths(command) if not (ROOT / p.split("::")[0]).exists()]
            assert not missing, f"{script}: pytest on missing paths {missing}"
    failures = [
        f"{' '.join(c)}\n{parsed[tuple(c)]['output'][-1500:]}"
        for c in parsed_commands(commands)
        if not parsed[tuple(c)]["ok"]
    ]
    assert not failures, "\n\n".join(failures)


@pytest.mark.slow
def test_gpu_session_runs_in_cpu_smoke_mode(tmp_path):
    """gpu_session.sh for real on the CPU (the tiny model, one round, W4 over gloo): every part exits 0 and the table
    at the end has each row."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    done = run_script(
        ["bash", "benchmarks/gpu_session.sh"],
        timeout=400,
        OUT=str(out),
        LOGS=str(logs),
        DEVICE="cpu",
        DTYPE="float32",
        PRESET="tiny",
        W1_SCALE="0.005",
        ROUNDS="1",
        W4_RUNS="1",
        W4_ARGS="--backend gloo --buffer-mib 4 --updates 2",
        BUDGET_S="390",
        MODEL=str(tmp_path / "model"),
    )
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    exits = [line.split() for line in summary.splitlines() if re.match(r"\s+exit \d+ after", line)]
    # model, gpu_tests (skipped on the CPU: pytest exits 0), w1_engines, w1_recording, w4_ipc_1
    assert len(exits) == 5 and all(words[1] == "0" for words in exits), summary
    for row in ("W1 LLM.generate, tuned:", "W1 LLM.generate, defaults:", "W1 LLM.generate, batch-invariant:",
                "W1 recording inside the step / not:", "W4 packed 4 MiB", "batch limits for the CPU"):  # fmt: skip
        assert row in summary, summary
    assert (out / "gpu_session_logs.tgz").exists()


def test_weight_sync_ipc_table_prints_its_copy_ceiling(monkeypatch, capsys):
    """--backend ipc needs CUDA to measure; its table (which read nccl's raw-broadcast key and crashed after the
    measurement) prints from an ipc run's info: the device-copy ceiling, no raw broadcast."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from weight_sync import Row, print_table

    info = dict(backend="ipc", model="qwen3-0.6b-shape", tensors=310, model_gb=1.192, device="cuda:0", torch="2.11")
    info |= dict(intra_op_threads=16, copy_bw_gbps=4100.0, copy_floor_s=0.00058, per_tensor_s=0.0034)
    phases = dict(pack=0.0021, map=0.0002, load=0.0001, sync=0.0009, release=0.0015, messages=0.0003)
    print_table([Row("ipc", "packed", 1024.0, None, 0.0117, 101.9, 0.05, phases_s=phases)], info)
    out = capsys.readouterr().out
    assert "device copy 4100 GB/s" in out and "raw broadcast" not in out
    assert "0.0117" in out
    assert "packed 1024 MiB, ms per update (medians): pack 2.10, map 0.20, load 0.10, sync 0.90, release 1.50" in out


def test_weight_sync_ipc_phases_add_up_per_update(monkeypatch):
    """The ipc engine's phase clock (needs no CUDA to count): each phase's seconds add up until taken, and the
    release, which runs inside the synchronize's phase (`_finish`), is counted apart from it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from weight_sync import PhaseTimedIPCEngine

    from rlserve.config import WeightTransferConfig

    engine = PhaseTimedIPCEngine(WeightTransferConfig("ipc"), torch.device("cpu"))
    engine._timed("map", lambda: time.sleep(0.02))
    engine._timed("map", lambda: time.sleep(0.02))
    engine._timed("sync", lambda: (time.sleep(0.03), engine._release()))
    phases = engine.take_phases()
    assert phases["map"] >= 0.04 and 0.03 <= phases["sync"] < 0.03 + 0.02 and phases["release"] < 0.01, phases
    assert engine.take_phases() == dict.fromkeys(PhaseTimedIPCEngine.PHASES, 0.0)


def test_process_cpu_counts_each_role_of_a_process_tree(monkeypatch):
    """server_throughput's per-role CPU (benchmarks/process_cpu.py) on a real tree: this process as the root (the
    API server's place), a child of a multiprocessing fork server (the engine core's) that spins for a while, and the
    fork server itself, a helper. The spinning child's CPU is the engine core's; the root's is the API server's."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import multiprocessing

    from process_cpu import cpu_by_role, role_usage

    context = multiprocessing.get_context("forkserver")
    child = context.Process(target=_spin, args=(0.3,))
    before = cpu_by_role(os.getpid())
    child.start()
    try:
        deadline = time.monotonic() + 30
        while child.pid not in (tree := cpu_by_role(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tree[child.pid].role == "engine core" and tree[os.getpid()].role == "API server", tree
        assert {p.role for pid, p in tree.items() if pid not in (child.pid, os.getpid())} == {"helper"}, tree
        after = tree
        while child.is_alive() and time.monotonic() < deadline:
            reading = cpu_by_role(os.getpid())
            if child.pid in reading:  # the last reading with the child in it: an exited one is not read
                after = reading
            time.sleep(0.02)
    finally:
        child.join(30)
    usage = role_usage(before, after)
    core_s, core_busiest_s = usage["engine core"]
    assert core_s == core_busiest_s > 0.25, usage  # the spin, and the child's import of this module
    assert usage["API server"][0] > 0, usage


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


# A stand-in for vLLM 0.33.0's test_packed_tensor.py: vLLM's imports through rlserve's surface, and one test of each
# kind the script tells apart (passes, fails, skips itself without a GPU).
VLLM_TEST_FIXTURE = """
import pytest
import torch

from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor


def test_passes():
    params = [("w", torch.arange(6.0).reshape(2, 3)), ("s", torch.tensor(1.5, dtype=torch.bfloat16))]
    chunk = pack_tensors(iter(params), lambda item: item[1], buffer_size_bytes=1024)
    out = unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes)
    assert [(n, t.tolist()) for n, t in out] == [(n, t.tolist()) for n, t in params]


def test_fails():
    assert False, "a failure"


def test_needs_a_gpu():
    pytest.skip("Need at least 1 GPU for this test")
"""


def test_vllm_rl_tests_classifies_a_fixture(tmp_path):
    """The script over an unpacked tree (no download): the fixture runs under `rlserve run`, each test lands in
    its class, and the figure counts only the applicable ones."""
    tests = tmp_path / "tests" / "distributed"
    tests.mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "test_packed_tensor.py").write_text(VLLM_TEST_FIXTURE)
    command = [sys.executable, "benchmarks/vllm_rl_tests.py", "--versions", "0.33.0"]
    command += ["--source-dir", f"0.33.0={tmp_path}", "--files", "tests/distributed/test_packed_tensor.py"]
    done = run_script(command, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "| tests/distributed/test_packed_tensor.py | 1 | 1 | 1 | 2 | 50% |" in done.stdout, done.stdout
    assert "not applicable x1: Need at least 1 GPU for this test" in done.stdout
    assert "figure vLLM 0.33.0: 1 / 2 = 50.0%" in done.stdout


def test_vllm_rl_tests_names_a_bad_source_dir(tmp_path):
    done = run_script([sys.executable, "benchmarks/vllm_rl_tests.py", "--source-dir", f"0.33.0={tmp_path}"])
    assert done.returncode != 0 and f"{tmp_path} has no tests/ directory" in done.stderr, done.stderr


@pytest.mark.slow
def test_gpu_fp8_runs_in_cpu_smoke_mode(tmp_path):
    """gpu_fp8.sh for real on the CPU (SMOKE=1: tiny presets, one timed run each): its MoE W1 part measures bf16 and
    fp8 (FP8 attention and experts), the update part both layouts, and the table at the end has their rows and says
    what was left out (the dense W1 part and the parity rows, whose scripts' own smokes run them)."""
    done = run_script(
        ["bash", "benchmarks/gpu_fp8.sh"],
        timeout=300,
        OUT=str(tmp_path),
        SMOKE="1",
        REPEATS="1",
        ONLY="w1_30b fp8_update",
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "rc.txt").read_text().split() == ["w1_30b", "rc=0", "fp8_update", "rc=0"]
    table = done.stdout.split("== summary")[-1]
    for row in ("W1 Qwen3-30B-A3B shape, bf16:", "W1 Qwen3-30B-A3B shape, fp8:", "x bf16 (goal 1.3x)",
                "full update load, fp8:", "W1 Qwen3-8B shape: missing", "parity: missing"):  # fmt: skip
        assert row in table, table


def test_vllm_033_unique_id_tests_pass_on_rlserve(vllm_source) -> None:
    """vLLM 0.33.0's own tests/distributed/test_weight_transfer_nccl_uid.py (the NCCL backend's two rendezvous forms
    and their validation), from its sdist, run by the script under `rlserve run`: every applicable test passes, so a
    regression of the figure fails CI. The fastest in-scope file (about 6 s); the script's full run is minutes."""
    root = vllm_source("0.33.0").root
    command = [sys.executable, "benchmarks/vllm_rl_tests.py", "--versions", "0.33.0", "--source-dir", f"0.33.0={root}"]
    done = run_script([*command, "--files", "tests/distributed/test_weight_transfer_nccl_uid.py"], timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "FAILED" not in done.stdout, done.stdout
    figure = re.search(r"figure vLLM 0\.33\.0: (\d+) / (\d+) =", done.stdout)
    assert figure, done.stdout
    passed, applicable = map(int, figure.groups())
    assert passed == applicable >= 14, done.stdout  # 14 run without a GPU
