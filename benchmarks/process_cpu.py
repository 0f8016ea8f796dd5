"""CPU time of a server's processes by role, read from /proc (Linux): which process bounds W7.

`rlserve serve` runs as one process tree: the API server (the root, or with `--api-server-count` N the root's
spawned children, the root then only supervising), the engine core (a child of the fork server, with any workers it
starts) and helpers (the fork server, multiprocessing's resource tracker). `cpu_by_role(root)` reads every process
of the tree at one moment; two readings around a measurement give each role's CPU seconds and its busiest
process's, which says whether one process is at its core's limit (a busiest share near 1.0 of the wall time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ROLES = ("API server", "engine core")


@dataclass(frozen=True)
class ProcessCpu:
    role: str  # one of ROLES, or "helper"
    cpu_s: float  # user + system, the whole life of the process so far


def _read(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds, command line) of a live process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": the name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S, cmdline


def cpu_by_role(root: int) -> dict[int, ProcessCpu]:
    """Every live process under `root` (itself included), with its role and CPU seconds."""
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _read(int(entry.name))) is not None:
            procs[int(entry.name)] = info
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    tree: dict[int, ProcessCpu] = {}
    todo = [root] if root in procs else []
    while todo:
        pid = todo.pop()
        ppid, cpu_s, cmdline = procs[pid]
        parent_cmdline = procs[ppid][2] if ppid in procs else ""
        # A core's own children (tensor-parallel workers) are the engine core's too.
        if "multiprocessing.forkserver" in parent_cmdline or (ppid in tree and tree[ppid].role == "engine core"):
            role = "engine core"
        elif pid == root or "multiprocessing.spawn" in cmdline:
            role = "API server"
        else:
            role = "helper"
        tree[pid] = ProcessCpu(role, cpu_s)
        todo += children.get(pid, [])
    return tree


def role_usage(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> dict[str, tuple[float, float]]:
    """{role: (CPU seconds of all its processes, CPU seconds of its busiest)} between two readings. A supervising
    root (several API servers) does almost nothing, so the busiest API server is one that serves."""
    usage: dict[str, list[float]] = {role: [] for role in ROLES}
    for pid, proc in after.items():
        if proc.role in usage:
            start = before[pid].cpu_s if pid in before else 0.0
            usage[proc.role].append(proc.cpu_s - start)
    return {role: (sum(spent), max(spent, default=0.0)) for role, spent in usage.items()}
