"""The server tests' start-up (conftest._wait_healthy): a server whose port another process took before it bound it
(free_port's port is free only when asked) is started again on a new port, and the test's handle follows it.
Stand-in processes, not `rlserve serve`: this checks the harness, which every server test's start goes through."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PORT_RETRIES, _stop, _wait_healthy
from server_helpers import Server, free_port

BUSY = "import sys; print('OSError: [Errno 98] Address already in use'); sys.exit(1)"
HEALTHY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def stand_in(tmp_path: Path, name: str, script: str, busy_starts: list[int]) -> Server:
    """A 'server' that fails as a taken port makes rlserve serve fail while busy_starts[0] > 0, then answers."""
    port = free_port()
    log = tmp_path / f"{name}.log"
    busy = busy_starts[0] > 0
    busy_starts[0] -= 1
    with log.open("wb") as out:
        cmd = [sys.executable, "-c", BUSY if busy else script, str(port)]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return Server(
        f"http://127.0.0.1:{port}", proc, log, {}, lambda: stand_in(tmp_path, name + "-again", script, busy_starts)
    )


def test_a_taken_port_starts_the_server_again_on_another(tmp_path: Path) -> None:
    server = stand_in(tmp_path, "server", HEALTHY, [2])
    first = server.url
    try:
        _wait_healthy(server)
        assert server.url != first and server.proc.poll() is None and server.log.name == "server-again-again.log"
    finally:
        _stop(server)


def test_other_failures_and_endless_taken_ports_are_raised(tmp_path: Path) -> None:
    failing = Server(
        "http://127.0.0.1:9", subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]), tmp_path / "x.log"
    )
    failing.log.write_text("some other start-up error\n")
    failing.relaunch = lambda: pytest.fail("only a taken port is retried")
    with pytest.raises(RuntimeError, match="server exited with 3"):
        _wait_healthy(failing)
    always_busy = stand_in(tmp_path, "busy", HEALTHY, [PORT_RETRIES + 1])
    with pytest.raises(RuntimeError, match="Address already in use"):
        _wait_healthy(always_busy)
