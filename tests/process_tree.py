"""Reading the process tree from /proc (Linux), for tests that check which processes an engine left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[0] != "Z":
                parents[int(entry)] = stat[1]
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        found += children
        frontier += children
    return found


def engine_core_pids(pid: int) -> list[int]:
    """The engine-core processes below `pid`: the children of multiprocessing's fork server."""
    return [p for p in descendants(pid) if _is_forkserver_child(p)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def _is_forkserver_child(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and "multiprocessing.forkserver" in _cmdline(stat[1])


def survivors(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Those of `pids` still alive after `timeout` (helpers such as the fork server exit just after their parent)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
