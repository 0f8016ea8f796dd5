"""vLLM's own RL tests, run unchanged against rlserve on the CPU: the share of those applicable here that pass.

    python benchmarks/vllm_rl_tests.py                      # 0.24.0 and 0.33.0, sdists fetched into --download-dir
    python benchmarks/vllm_rl_tests.py --versions 0.33.0 --source-dir 0.33.0=/tmp/vllm-0.33.0

For each vLLM release, its sdist (the tests ship only there, not in the wheel) is fetched from the package index and
unpacked into `--download-dir` by rlserve/vllm_sdist.py (the tests' vLLM fixtures share that cache). Nothing of it is
kept in rlserve. Each test file in SCOPE then runs in its own
`rlserve run -- python -m pytest FILE` (rlserve's vllm import surface: `import vllm...` resolves to rlserve), from a
directory holding only a link to the release's `tests/` (so that `tests.distributed...` imports resolve and vLLM's own
package in the sdist never does), with `--noconftest`: vLLM's conftests are its harness for starting models and
KV-event publishers, not RL API, and none of the selected files needs a fixture from them.

Each test is classified, by this rule:
- not applicable on CPU: the test skipped itself (its own `skipif(not torch.cuda.is_available())`,
  `pytest.skip("Need at least 1 GPU")`, `importorskip` of an optional package such as `modelexpress_rl`); every test
  of the selected files that needs CUDA says so itself, so no list of exceptions is kept here;
- passed; otherwise failed (a failure, an error, a test still running after TEST_TIMEOUT_S, or a file whose
  collection failed: then its tests are counted from its source, every `def test_*` times its literal `parametrize`
  lists, and all of them are counted as failed).
Files outside SCOPE (OUT_OF_SCOPE, each with its reason) are listed, not run. The figure is passed / applicable.
Every failure is printed: with its reason when KNOWN_FAILURES lists it, as new otherwise.
"""

from __future__ import annotations

import argparse
import ast
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlserve import vllm_sdist

VERSIONS = ("0.24.0", "0.33.0")

# The files in scope, per release: vLLM's tests of the RL API that rlserve implements (weight transfer to the engine,
# its trainer side, its wire formats). Why each is in scope is said beside it.
SCOPE: dict[str, dict[str, str]] = {
    "0.24.0": {
        "tests/distributed/test_weight_transfer.py": (
            "the weight-transfer engines: NCCL / IPC init and update info parsing and validation, the engine "
            "registry, the sparse update info, vLLM's trainer_init / trainer_send_weights over a real group"
        ),
        "tests/distributed/test_packed_tensor.py": (
            "the packed broadcast the NCCL backend and its trainers use: pack_tensors, "
            "packed_nccl_broadcast_producer / consumer, unpack_tensor, the packed IPC producer / consumer"
        ),
    },
    "0.33.0": {
        "tests/distributed/test_weight_transfer.py": (
            "the weight-transfer engines and their trainer side: update info / ParamMeta validation, the registry "
            "and its lazy backends, the trainer clients' protocol, the deferred-processing contract, the trainer "
            "engines' init / send_weights"
        ),
        "tests/distributed/test_weight_transfer_nccl_uid.py": (
            "the NCCL backend's unique-id rendezvous (nccl_unique_id_b64) for torch-free trainers"
        ),
        "tests/distributed/test_packed_tensor.py": (
            "the packed broadcast: pack_tensors, packed_nccl_broadcast_producer / consumer, unpack_tensor, the "
            "packed IPC producer / consumer"
        ),
    },
}

# Files in the releases' RL test areas that are not run, and why.
_NEEDS_MODEL = "its tests start vLLM on a Hugging Face model (download) through vLLM's harness tests/utils.py"
_GPU_ONLY = "every test in it skips without a GPU, and it imports vLLM's harness tests/utils.py (vLLM internals)"
OUT_OF_SCOPE: dict[str, dict[str, str]] = {
    "0.24.0": {
        "tests/entrypoints/weight_transfer/test_weight_transfer_llm.py": _GPU_ONLY,
        "tests/entrypoints/serve/dev/test_sleep.py": _NEEDS_MODEL,
        "tests/entrypoints/serve/dev/rpc/test_collective_rpc.py": _NEEDS_MODEL,
        "tests/entrypoints/llm/test_collective_rpc.py": _NEEDS_MODEL,
        "tests/v1/worker/test_gpu_worker_weight_transfer.py": "vLLM's GPU worker internals, not the RL API",
    },
    "0.33.0": {
        "tests/entrypoints/rl/weight_transfer/test_offline.py": _GPU_ONLY,
        "tests/entrypoints/rl/state_transitions/test_pause_resume.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/state_transitions/test_pause_multi_frontend.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/state_transitions/test_weight_checker.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/weight_transfer_metrics/test_across_api_servers_metrics.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/return_routed_experts/test_openai_api.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/return_routed_experts/test_scale_out_api.py": _NEEDS_MODEL,
        "tests/entrypoints/serve/dev/rpc/test_collective_rpc.py": _NEEDS_MODEL,
        "tests/entrypoints/llm/test_collective_rpc.py": _NEEDS_MODEL,
        "tests/entrypoints/rl/return_routed_experts/test_route_request_bodies.py": (
            "mounts vLLM's own FastAPI routers (vllm.entrypoints.rl.online.api_router) over vLLM's engine-client "
            "internals; rlserve's routes are its own server's"
        ),
        "tests/entrypoints/rl/state_transitions/test_sleep.py": (
            "vLLM's sleep router and metrics objects over its engine-client internals, and a model server"
        ),
        "tests/entrypoints/rl/weight_transfer_metrics/test_weight_operation_metrics.py": (
            "vLLM's RL router and metrics objects (vllm.entrypoints.rl.online.metrics) over its engine-client internals"
        ),
        "tests/distributed/test_weight_transfer_m2n.py": (
            "the nccl_m2n backend (M:N resharding onto vLLM's model_executor linear layers, needs the nccl.m2n "
            "runtime), which rlserve does not implement"
        ),
        "tests/distributed/test_sharded_rdt_plan.py": (
            "the sharded_rdt backend's plans over vLLM's model_executor layers and reload internals; rlserve does "
            "not implement that backend (its registration is tested in test_weight_transfer.py)"
        ),
        "tests/distributed/test_sharded_rdt_producer.py": "the sharded_rdt backend over NIXL (RDMA); not implemented",
        "tests/distributed/test_sharded_rdt_trainer.py": "the sharded_rdt backend's trainer; not implemented",
        "tests/v1/worker/test_gpu_worker_weight_transfer.py": "vLLM's GPU worker internals, not the RL API",
    },
}


# The applicable tests that still fail, each with why: what rlserve does differently on purpose, or lacks. Keyed by the
# test's id within its file; the run prints each with its reason, and any other failure as new.
_IPC_HANDLE_CHECKED = (
    "rlserve checks each IPC handle's form (torch's 15 rebuild_cuda_tensor arguments) when it parses the update, so "
    "a malformed one is a 400 before any handle is opened; the test's handle is a placeholder tuple, which vLLM "
    "accepts until it opens it"
)
KNOWN_FAILURES: dict[str, dict[str, str]] = {
    "0.24.0": {"TestIPCEngineParsing::test_parse_update_info_ignores_none_pickled_handles": _IPC_HANDLE_CHECKED},
    "0.33.0": {
        "TestIPCEngineParsing::test_parse_update_info_ignores_none_pickled_handles": _IPC_HANDLE_CHECKED,
        "TestEngineRegistry::test_modelexpress_registration_is_native_and_lazy": (
            "rlserve registers the modelexpress backend lazily too, but under its own module path "
            "(rlserve.distributed.weight_transfer.modelexpress_engine); the test asserts the import of vLLM's path"
        ),
        "TestDeferredProcessingContract::test_the_rdt_engine_defers_and_overrides_the_drain": (
            "the sharded_rdt backend is not implemented: it pulls tensor slices over Ray's RDMA transport (NIXL) "
            "with plans baked over vLLM's model_executor weight loaders"
        ),
        "TestTrainerClients::test_http_client_pickles_ipc_handles_for_json": (
            "rlserve never unpickles request data: IPC handles travel as plain JSON, and the server refuses "
            "ipc_handles_pickled"
        ),
        "TestTrainerClients::test_ray_client_sends_typed_requests": (
            "rlserve's Ray client finishes an update and sets its weight version in one call "
            "(finish_weight_update(weight_version)), so no token is tagged with the old version under the new "
            "weights; vLLM's makes two calls"
        ),
        "test_sparse_nccl_checkpoint_chunks_to_ep_local_experts_cpu": (
            "vLLM applies sparse patches through the model's own weight loaders in checkpoint coordinates "
            "(load_checkpoint_weight_patches, expert-parallel aware); rlserve's sparse_nccl patches its parameters "
            "in place by name and refuses expert parallelism, and its group's broadcast returns a Work to wait on"
        ),
        "test_nccl_worker_learns_wire_params_from_init_handshake": (
            "the test replaces vLLM's worker_init_process_group(init_info, parallel_config); rlserve's engine "
            "joins through join_worker_group, which also takes the engine's device and weight_transfer_timeout_s"
        ),
        "test_nccl_worker_reuses_metadata_per_model": (
            "the same replaced worker_init_process_group; and rlserve's engine calls its nccl backend in the 0.24 "
            "shape (receive_weights(update_info, load_weights)) so it can roll back exactly what was written (the "
            "backend takes 0.33's receive_weights(update_info) too, from worker extensions)"
        ),
    },
}


@dataclass
class FileResult:
    path: str
    passed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    not_applicable: list[tuple[str, str]] = field(default_factory=list)
    collection_error: str = ""

    @property
    def applicable(self) -> int:
        return len(self.passed) + len(self.failed)


def count_tests(source: Path) -> int:
    """Tests in a file that pytest could not collect: each `def test_*` (module level or in a `Test*` class) times
    the lengths of its own and its class's literal `parametrize` lists."""

    def params(decorators: list[ast.expr]) -> int:
        n = 1
        for d in decorators:
            if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize" and len(d.args) > 1:
                values = d.args[1]
                n *= len(values.elts) if isinstance(values, ast.List | ast.Tuple) else 1
        return n

    def functions(body: list[ast.stmt], factor: int) -> int:
        return sum(
            factor * params(node.decorator_list)
            for node in body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
        )

    tree = ast.parse(source.read_text())
    total = functions(tree.body, 1)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            total += functions(node.body, params(node.decorator_list))
    return total


# This module is also the pytest plugin of each run (`-p vllm_rl_tests`): it writes every test's start and
# outcome to the file $RLSERVE_VLLM_RL_TESTS_LOG as it happens, and ends the run (faulthandler: the threads' stacks,
# then exit) when one test outlives TEST_TIMEOUT_S. A test that waits in C (a TCPStore rendezvous no peer joins)
# cannot be interrupted otherwise; the run then resumes after it.
LOG_ENV = "RLSERVE_VLLM_RL_TESTS_LOG"
TEST_TIMEOUT_S = 60


def _log(record: dict) -> None:
    with open(os.environ[LOG_ENV], "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if LOG_ENV in os.environ:
        _log({"start": nodeid})
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    if LOG_ENV in os.environ:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 (pytest's TestReport)
    if LOG_ENV not in os.environ:
        return
    if report.skipped:
        # a skip's longrepr is (path, line, "Skipped: why")
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _log({"node": report.nodeid, "outcome": "skipped", "why": why.removeprefix("Skipped: ")})
    elif report.failed:
        _log({"node": report.nodeid, "outcome": "failed", "why": _first_error_line(str(report.longrepr))})
    elif report.when == "call":
        _log({"node": report.nodeid, "outcome": "passed"})


def pytest_collectreport(report) -> None:  # noqa: ANN001 (pytest's CollectReport)
    if LOG_ENV in os.environ and report.failed:
        _log({"collect_error": report.nodeid, "why": _first_error_line(str(report.longrepr))})


def _first_error_line(text: str) -> str:
    """The exception pytest reports (its last "E " line), cut to one table cell."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[-1] if errors else text.strip().splitlines()[-1] if text.strip() else "")[:200]


def run_file(root: Path, path: str, workdir: Path) -> FileResult:
    """Run one file to the end: when a test hangs, the run ends and starts again with the tests already done and the
    hung one deselected (pytest collects in a fixed order)."""
    result = FileResult(path)
    outcomes: dict[str, tuple[str, str]] = {}  # node -> (outcome, why); a test's first failure wins
    done: set[str] = set()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
    }
    log = workdir / "results.jsonl"
    while True:
        log.write_text("")
        command = [sys.executable, "-m", "rlserve.cli", "run", "--", sys.executable, "-m", "pytest", path, "-q"]
        command += ["--noconftest", "-p", "no:cacheprovider", "-p", "vllm_rl_tests"]
        command += [f"--deselect={node}" for node in sorted(done)]
        # Output to a file, not a pipe: a daemon a test started (Ray's) may outlive pytest and hold a pipe open.
        with (workdir / "pytest.out").open("w") as out:
            done_run = subprocess.run(command, cwd=workdir, env={**env, LOG_ENV: str(log)}, stdout=out, stderr=out)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        if not records and done_run.returncode != 0:
            tail = (workdir / "pytest.out").read_text()[-2000:]
            raise SystemExit(f"vllm_rl_tests: {path}: pytest exited {done_run.returncode} before any test:\n{tail}")
        started = None
        for record in records:
            if "collect_error" in record:
                result.collection_error = record["why"]
                result.failed = [(f"{path}::*", record["why"])] * count_tests(root / path)
                return result
            if "start" in record:
                started = record["start"]
                done.add(started)
                continue
            node = record["node"]
            if node not in outcomes or outcomes[node][0] != "failed":
                outcomes[node] = (record["outcome"], record.get("why", ""))
            if node == started:
                started = None
        if started is None or started in outcomes:
            break
        outcomes[started] = ("failed", f"still running after {TEST_TIMEOUT_S} s (ended)")
    for node, (outcome, why) in outcomes.items():
        if outcome == "skipped":
            result.not_applicable.append((node, why))
        elif outcome == "failed":
            result.failed.append((node, why))
        else:
            result.passed.append(node)
    return result


def run_version(version: str, root: Path, files: list[str]) -> list[FileResult]:
    missing = [p for p in files if not (root / p).is_file()]
    if missing:
        raise SystemExit(f"vllm_rl_tests: {root} has no {', '.join(missing)} (not vLLM {version}'s source tree?)")
    with tempfile.TemporaryDirectory(prefix=f"vllm-{version}-tests-") as tmp:
        workdir = Path(tmp)
        (workdir / "tests").symlink_to(root / "tests", target_is_directory=True)
        results = []
        for path in files:
            started = time.monotonic()
            result = run_file(root, path, workdir)
            results.append(result)
            print(
                f"  ran {path} in {time.monotonic() - started:.0f} s: {len(result.passed)} passed, "
                f"{len(result.failed)} failed, {len(result.not_applicable)} not applicable",
                file=sys.stderr,
            )
        return results


def print_table(version: str, results: list[FileResult], verbose: bool) -> tuple[int, int]:
    print(f"\nvLLM {version}")
    print("| file | passed | failed | not applicable on CPU | applicable | passed / applicable |")
    print("|---|---:|---:|---:|---:|---:|")
    total_passed = total_applicable = 0
    for r in results:
        share = f"{100 * len(r.passed) / r.applicable:.0f}%" if r.applicable else "-"
        note = f" (collection error: {r.collection_error})" if r.collection_error else ""
        print(
            f"| {r.path}{note} | {len(r.passed)} | {len(r.failed)} | {len(r.not_applicable)} | {r.applicable} "
            f"| {share} |"
        )
        total_passed += len(r.passed)
        total_applicable += r.applicable
    for path, why in OUT_OF_SCOPE.get(version, {}).items():
        print(f"  not run: {path}: {why}")
    reasons: dict[str, int] = {}
    for r in results:
        for _, why in r.not_applicable:
            reasons[why] = reasons.get(why, 0) + 1
    for why, n in sorted(reasons.items(), key=lambda item: -item[1]):
        print(f"  not applicable x{n}: {why}")
    known = KNOWN_FAILURES.get(version, {})
    for r in results:
        for node, why in r.failed:
            reason = known.get(node.split("::", 1)[-1])
            if reason is not None:
                print(f"  still failing, known: {node}: {reason}" + (f" [{why}]" if verbose else ""))
            else:
                print(f"  FAILED, new: {node}: {why}")
    share = 100 * total_passed / total_applicable if total_applicable else 0.0
    print(f"vLLM {version}: {total_passed} / {total_applicable} applicable passed ({share:.1f}%)")
    return total_passed, total_applicable


def parse_source_dirs(values: list[str], versions: list[str]) -> dict[str, Path]:
    dirs = {}
    for value in values:
        version, sep, path = value.partition("=")
        if not sep or version not in versions:
            raise SystemExit(f"vllm_rl_tests: --source-dir {value!r}: expected VERSION=DIR with VERSION in {versions}")
        if not (Path(path) / "tests").is_dir():
            raise SystemExit(f"vllm_rl_tests: --source-dir {value!r}: {path} has no tests/ directory")
        dirs[version] = Path(path).resolve()
    return dirs


def _fetch(version: str, download_dir: Path, index_url: str) -> Path:
    try:
        return vllm_sdist.unpacked_sdist(version, download_dir, index_url)
    except (LookupError, ValueError) as error:
        raise SystemExit(f"vllm_rl_tests: {error}") from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", default=",".join(VERSIONS), help=f"comma-separated, of {', '.join(VERSIONS)}")
    parser.add_argument("--download-dir", type=Path, default=vllm_sdist.CACHE_DIR, help="where sdists unpack")
    parser.add_argument(
        "--source-dir", action="append", default=[], metavar="VERSION=DIR", help="an unpacked source tree to use"
    )
    parser.add_argument(
        "--index-url", default=vllm_sdist.DEFAULT_INDEX, help="the package index (PEP 691 JSON) to fetch from"
    )
    parser.add_argument("--files", default="", help="comma-separated subset of the in-scope files to run")
    parser.add_argument("--verbose", action="store_true", help="add each known failure's message to its reason")
    args = parser.parse_args(argv)

    versions = [v for v in args.versions.split(",") if v]
    unknown = [v for v in versions if v not in SCOPE]
    if unknown or not versions:
        parser.error(f"--versions: {', '.join(unknown) or 'none given'}: expected some of {', '.join(VERSIONS)}")
    source_dirs = parse_source_dirs(args.source_dir, versions)
    wanted = [f for f in args.files.split(",") if f]
    in_scope = {f for v in versions for f in SCOPE[v]}
    if [f for f in wanted if f not in in_scope]:
        parser.error(f"--files: {', '.join(f for f in wanted if f not in in_scope)} not in scope: {sorted(in_scope)}")

    started = time.monotonic()
    figures = {}
    for version in versions:
        root = source_dirs.get(version) or _fetch(version, args.download_dir, args.index_url)
        files = [f for f in SCOPE[version] if not wanted or f in wanted]
        if not files:
            continue
        print(f"vLLM {version} from {root}", file=sys.stderr)
        results = run_version(version, root, files)
        figures[version] = print_table(version, results, args.verbose)
    print()
    for version, (passed, applicable) in figures.items():
        share = 100 * passed / applicable if applicable else 0.0
        print(f"figure vLLM {version}: {passed} / {applicable} = {share:.1f}% of the applicable tests pass")
    print(f"ran in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
