"""The table gpu_session.sh prints last: medians and ranges from the JSON its parts wrote into one folder.

    python benchmarks/session_table.py LOGS

Reads LOGS/w1_engines.json (offline_generate.py --engines ... --out), LOGS/w1_recording.json (throughput.py --out)
and LOGS/w4_ipc_*.json (weight_sync.py --out, one per run); a part that wrote nothing shows as missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def spread(values: list[float], fmt: str) -> str:
    median, low, high = (format(v, fmt) for v in (statistics.median(values), min(values), max(values)))
    return f"{median} ({low}-{high}, {len(values)} runs)"


def w1_engine_rows(path: Path) -> list[str]:
    engines = json.loads(path.read_text())
    first = statistics.median(next(iter(engines.values()))["tok_s"])
    return [
        f"W1 LLM.generate, {name}: {spread(e['tok_s'], ',.0f')} tok/s, {statistics.median(e['tok_s']) / first:.3f}x"
        for name, e in engines.items()
    ]


def w1_recording_rows(path: Path) -> list[str]:
    rows = {r["workload"]: r for r in json.loads(path.read_text())["rows"]}
    lines = [
        f"W1 throughput.py, {name} ({r['schedule']}): {spread(r['run_tok_s'], ',.0f')} tok/s, "
        f"{r['fraction']:.1%} of the roofline"
        for name, r in rows.items()
    ]
    if "W1" in rows and "W1/inline" in rows:
        lines.append(f"W1 recording inside the step / not: {rows['W1/inline']['tok_s'] / rows['W1']['tok_s']:.3f}x")
    return lines


def w4_rows(paths: list[Path]) -> list[str]:
    by_config: dict[tuple, list[float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["rows"]:
            key = (row["mode"], row["buffer_mib"], row["num_buffers"])
            by_config.setdefault(key, []).append(row["seconds"] * 1e3)
    return [
        f"W4 {mode}{'' if mib is None else f' {mib:.0f} MiB'}{'' if bufs is None else f' x{bufs}'}: "
        f"{spread(ms, '.2f')} ms (each run's median update)"
        for (mode, mib, bufs), ms in by_config.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", type=Path)
    logs = ap.parse_args().logs
    lines = []
    for name, rows in (("w1_engines.json", w1_engine_rows), ("w1_recording.json", w1_recording_rows)):
        path = logs / name
        lines += rows(path) if path.exists() else [f"{name}: missing (its part failed or was skipped)"]
    w4 = sorted(logs.glob("w4_ipc_*.json"))
    lines += w4_rows(w4) if w4 else ["w4_ipc_*.json: missing (its part failed or was skipped)"]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
