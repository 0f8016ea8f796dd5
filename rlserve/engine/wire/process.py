"""Small helpers that the engine's processes share: whether a process lives, a free port, and how long the ranks of
one engine wait for each other in a collective."""

from __future__ import annotations

import datetime
import os
import socket

# A rank waits in a collective with its peers (the data-parallel ranks' all-gather, their expert-parallel exchange)
# for as long as a peer runs a control call between two steps (a checkpoint reload, a weight update's transfer):
# generous. A peer that died fails the front end's liveness check long before.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (an IPv4 or IPv6 address) now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a free port on `host` and not listening, with SO_REUSEADDR: while it stays open the kernel
    gives that port to no other socket (an outgoing connection's local port included, which is how a port from
    `free_port` gets taken before its listener starts), yet a listener that also sets SO_REUSEADDR (torch's TCPStore,
    uvicorn) may bind it. Close it once the listener is up; the port is `getsockname()[1]`."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def pid_alive(pid: int) -> bool:
    """For a process that did not start the one it watches (an API server's core, a rank's rank 0): the process
    exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def process_age_s() -> float:
    """Seconds since this process started (Linux's /proc: the start time in clock ticks after boot against the
    uptime; 10 ms resolution), for the start-up timeline's log lines: the interpreter's start and the imports count,
    which no clock read inside the program sees."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
