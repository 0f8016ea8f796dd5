"""README.md's CPU quick start runs as written, and the front page and docs/ keep their shape.

The fenced shell commands of README.md are read from the page itself and run in order in a temporary directory, on
loopback, each under a time limit: a command that ends in `&` is a server, started in the background and waited for
on /health; the page's Python blocks (the RL loop, a trainer of that server) run after the commands, against it.
Only two rewrites are made, both of ports: the page's server port and weight-transfer port become free ones, so that
the test cannot collide with another server on the machine. Every process the test starts is stopped, with what it
started. Commands that are not run are listed below with the reason; a new command on the page runs unless it is
added there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from process_tree import descendants, survivors

from rlserve.rl.demo import EXIT_NO_IMPROVEMENT, LEGEND, DemoConfig, StepRecord

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

MAX_README_LINES = 120
MAX_LINE_CHARS = 120
# The two set-up lines: the first lines after the title, kept exactly as they are (CI and the project's rules read
# them), and the only lines allowed past MAX_LINE_CHARS. CI runs them itself: .ci/run sets up its fresh clone the
# same way (less the demo, which test_readme_demo runs) and then runs this very suite.
SETUP_LINES = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e '.[test]' && pip "
    "install --no-deps -r requirements-frameworks.txt && rlserve demo": "the fresh-machine set-up: .ci/run does it",
    ". .venv/bin/activate && OMP_NUM_THREADS=1 pytest -q -n 2": "the test suite: this test is part of it",
}
GPU_ONLY = {
    "pip install -e '.[gpu]'": "the GPU extra (Triton): installs packages, for the GPU path only",
    "rlserve serve Qwen/Qwen3-0.6B": "a hub download served on a GPU",
}
# Run by its own test, marked slow: the whole demo takes about a minute on two idle cores, two when they are shared.
SLOW = {"rlserve demo": "test_readme_demo"}

# The page's ports, replaced by free ones (checked present, so the replacement is never silently a no-op).
SERVER_PORT = "8000"
TRANSFER_PORT = "29500"
COMMAND_TIMEOUT_S = 180.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def fenced_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return re.findall(r"^```(?:" + "|".join(languages) + r")\n(.*?)^```", text, flags=re.M | re.S)


def shell_commands(text: str) -> list[str]:
    """The logical lines of the page's shell blocks: continuation lines (a trailing backslash) joined, blank lines and
    whole-line comments left out."""
    commands = []
    for block in fenced_blocks(text, ("bash", "sh", "shell")):
        block = re.sub(r"\\\n\s*", "", block)
        commands += [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return commands


def without_comment(command: str) -> str:
    """The command without a trailing `# comment` (outside quotes, as bash reads it)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command


def skip_reason(command: str) -> str | None:
    bare = without_comment(command)
    if bare in SETUP_LINES:
        return SETUP_LINES[bare]
    for prefix, reason in {**GPU_ONLY, **SLOW}.items():
        if bare == prefix or bare.startswith(prefix + " "):
            return reason
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """This tree's rlserve, on the interpreter running the tests (its bin directory first on PATH: `rlserve`)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(command: str, cwd: Path, timeout: float = COMMAND_TIMEOUT_S) -> str:
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def stop(proc: subprocess.Popen) -> None:
    """Stop `proc` and everything it started: SIGTERM (a server shuts its engine down), then SIGKILL for whatever is
    still alive in its session or below it."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)
    with_session = [p for p in tree if _session(p) == proc.pid]
    for pid in survivors(tree, timeout=5.0) + with_session:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group: anything left of the command
    except (ProcessLookupError, PermissionError):
        pass


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def wait_healthy(proc: subprocess.Popen, port: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=2.0) as http:  # one client for every poll (httpx.get makes one, TLS context and all)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    raise AssertionError(f"the server was not healthy after {START_TIMEOUT_S:g} s:\n{log.read_text()[-4000:]}")


def with_ports(text: str, ports: dict[str, str]) -> str:
    for page_port, port in ports.items():
        text = re.sub(rf"\b{page_port}\b", port, text)
    return text


@pytest.fixture
def readme() -> str:
    return README.read_text()


def test_every_command_runs_or_says_why_not(readme: str) -> None:
    commands = [without_comment(c) for c in shell_commands(readme)]
    assert list(SETUP_LINES) == commands[:2], "the set-up lines must be the page's first commands, as they are"
    assert readme.splitlines()[2:6] == ["```bash", *SETUP_LINES, "```"], "the set-up lines follow the title"
    # Each skipped or slow entry still names a command of the page: the lists cannot go stale unnoticed.
    for listed in [*GPU_ONLY, *SLOW]:
        assert any(c == listed or c.startswith(listed + " ") for c in commands), f"{listed!r} is not on the page"
    assert SERVER_PORT in readme and TRANSFER_PORT in readme


def test_quick_start_runs_as_written(readme: str, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("the quick start's request is a curl command, and curl is not installed")
    ports = {SERVER_PORT: str(free_port()), TRANSFER_PORT: str(free_port())}
    servers: list[subprocess.Popen] = []
    outputs: dict[str, str] = {}
    try:
        for command in shell_commands(readme):
            if skip_reason(command) is not None:
                continue
            bare = with_ports(without_comment(command), ports)
            if bare.endswith("&"):  # a server: started in the background, ready once /health answers
                log = tmp_path / f"server-{len(servers)}.log"
                with log.open("w") as sink:
                    proc = subprocess.Popen(
                        ["bash", "-c", f"exec {bare[:-1].strip()}"],
                        cwd=tmp_path,
                        env=env(),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                servers.append(proc)
                port = re.search(r"--port (\d+)", bare)
                wait_healthy(proc, port.group(1) if port else SERVER_PORT, log)
                continue
            outputs[command.split()[0] + " " + command.split()[1]] = run(bare, tmp_path)
        assert servers, "the quick start starts a server"
        for i, code in enumerate(fenced_blocks(readme, ("python",))):
            script = tmp_path / f"readme_{i}.py"
            script.write_text(with_ports(code, ports))
            outputs[f"python {i}"] = run(f"{sys.executable} {script.name}", tmp_path)
    finally:
        for proc in servers:
            stop(proc)

    # What each step printed is what the page says it prints.
    assert (tmp_path / "toy" / "config.json").is_file() and list((tmp_path / "toy").glob("*.safetensors"))
    samples = [json.loads(line) for line in outputs["rlserve generate"].splitlines() if line.startswith("{")]
    # A random model samples its end-of-text token now and then (which token depends on the CPU's last bits).
    assert len(samples) == 1 and len(samples[0]["top_logprobs"][0]) == 2
    tokens = samples[0]["token_ids"]
    assert len(tokens) == 8 or (0 < len(tokens) < 8 and samples[0]["finish_reason"] == "stop")
    curl = next(out for key, out in outputs.items() if key.startswith("curl "))
    choice = json.loads(curl)["choices"][0]
    assert choice["text"] and choice["token_weight_versions"] and choice["logprobs"]["token_logprobs"]
    assert "engine weight version: step-3" in outputs["python 0"]


@pytest.mark.slow
def test_readme_demo(readme: str, tmp_path: Path) -> None:
    """The quick start's demo, as written: async GRPO with a weight update per step, which exits 0 when the reward
    rose beyond noise (about a minute on two idle cores). The one full run of `rlserve demo` in the suite, so it checks
    the whole of what the run leaves: the log of every step, the plot, the table, the engine's log, no port left open
    (tests/rl/test_demo.py runs Ctrl-C and the example)."""
    (command,) = [c for c in shell_commands(readme) if skip_reason(c) == "test_readme_demo"]
    out = run(without_comment(command), tmp_path, timeout=600)
    assert "PASS: the reward rose" in out
    assert list(tmp_path.glob("runs/*/log.json")) and list(tmp_path.glob("runs/*/reward.png"))
    (run_dir,) = tmp_path.glob("runs/*")
    check_demo_run(run_dir, out, 0)


def check_demo_run(out: Path, stdout: str, returncode: int) -> None:
    """What a finished `rlserve demo` run (output directory `out`) must have written and printed."""
    log = json.loads((out / "log.json").read_text())
    config = log["config"]
    assert config["steps"] == DemoConfig().steps and config["backend"] == "nccl"
    steps = log["steps"]
    assert [s["step"] for s in steps] == list(range(1, config["steps"] + 1))
    assert set(steps[0]) == set(StepRecord.__dataclass_fields__)
    # Every step's update went through: one version per step, and the engine ends at the last one.
    assert [s["weight_version"] for s in steps] == [s["step"] for s in steps]
    assert log["summary"]["engine_weight_version"] == str(config["steps"])
    assert log["summary"]["trainer_weight_version"] == config["steps"]
    groups, group_size = config["prompts_per_step"], config["group_size"]
    for s in steps:
        assert 0.0 <= s["reward"] <= 1.0
        # A group counts with at least one sample not dropped for lag.
        assert s["num_groups"] == groups and groups <= s["num_samples"] <= groups * group_size
        assert 0 <= s["lag_mean"] <= s["lag_max"] <= config["max_lag"]
        # fp32 on both sides, each token scored under the weights that sampled it: no mismatch beyond rounding.
        assert 0.0 <= s["mismatch_kl"] < 1e-8
        assert s["sync_ms"] > 0 and s["pause_ms"] >= s["sync_ms"]
        assert s["ratio_min"] <= s["ratio_mean"] <= s["ratio_max"]
    summary = log["summary"]
    assert summary["reward_rose"] == (returncode == 0)
    assert {"start_reward", "end_reward", "margin", "dropped_samples", "wall_s"} <= set(summary)
    png = (out / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[20:24], "big") == 9 * 120  # the figure's height in pixels: three panels at 120 dpi
    # The columns are explained once, above the table; the verdict follows the exit status.
    assert stdout.count(LEGEND) == 1 and "mismatch KL" in stdout
    assert ("PASS: the reward rose" in stdout) == (returncode == 0)
    assert (f"exit status {EXIT_NO_IMPROVEMENT}" in stdout) == (returncode == EXIT_NO_IMPROVEMENT)
    # The engine's start-up facts: its phases, and serve's line with model, device, dtype, KV cache and URL.
    engine_log = (out / "engine.log").read_text()
    assert "model loaded on cpu" in engine_log
    assert "on cpu in float32: KV cache" in engine_log and f"{summary['engine_url']}/v1" in engine_log
    url = urlparse(summary["engine_url"])
    with pytest.raises(OSError), socket.create_connection((url.hostname, url.port), timeout=2):
        pass  # the engine's port is closed


# --- the page's shape -------------------------------------------------------------------------------------------


def test_readme_is_a_front_page(readme: str) -> None:
    lines = readme.splitlines()
    assert len(lines) < MAX_README_LINES, f"README.md has {len(lines)} lines"
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if path == README and line in SETUP_LINES:
                continue
            assert len(line) <= MAX_LINE_CHARS, f"{path.name}:{number} has {len(line)} characters"


def _links(path: Path) -> Iterator[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # code is not markdown
    text = re.sub(r"`[^`\n]*`", "", text)
    yield from re.findall(r"\]\(([^)\s]+)\)", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_relative_links_point_to_files_that_exist() -> None:
    pages = [README, *sorted(DOCS.glob("*.md"))]
    assert len(pages) > 1, "docs/ holds the guides"
    for page in pages:
        for link in _links(page):
            if re.match(r"[a-z]+:", link):  # http(s), mailto: not checked here
                continue
            target, _, anchor = link.partition("#")
            resolved = (page.parent / target).resolve() if target else page
            assert resolved.exists(), f"{page.relative_to(ROOT)} links to {link}, which does not exist"
            if anchor and resolved.suffix == ".md":
                assert anchor in _anchors(resolved), f"{page.relative_to(ROOT)} links to {link}: no such heading"
