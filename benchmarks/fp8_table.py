"""The table gpu_fp8.sh prints last: issue 31's figures, FP8 against bf16, from the JSON its parts wrote in one folder.

    python benchmarks/fp8_table.py LOGS

Reads LOGS/w1_8b.json and LOGS/w1_30b.json (offline_generate.py --out: each set-up's timed runs), LOGS/fp8_update.json
(fp8_update.py --out) and LOGS/parity-fp8.json (parity.py --out); a part that wrote nothing shows as missing. Goals
(issue 31): W1 >= 1.4x bf16 on the Qwen3-8B shape, >= 1.3x on the Qwen3-30B-A3B shape, a full update with
quantization <= 1.5x bf16's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

W1_GOALS = {"w1_8b": ("Qwen3-8B shape", 1.4), "w1_30b": ("Qwen3-30B-A3B shape", 1.3)}
UPDATE_GOAL = 1.5
PARITY_ROWS = ("bf16", "fp8", "fp8 after 10 updates")  # parity.py's names: the bf16 engine, the FP8 one


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def w1_rows(logs: Path, name: str) -> list[str]:
    shape, goal = W1_GOALS[name]
    runs = _load(logs / f"{name}.json")
    if not runs:
        return [f"W1 {shape}: missing ({name}.json not written)"]
    medians = {label.rsplit("/", 1)[-1]: statistics.median(r["tok_s"]) for label, r in runs.items()}
    counts = {label.rsplit("/", 1)[-1]: len(r["tok_s"]) for label, r in runs.items()}
    bf16 = medians.get("none")
    rows = []
    for method, median in medians.items():
        ratio = f", {median / bf16:.2f}x bf16 (goal {goal}x)" if bf16 and method != "none" else ""
        label = "bf16" if method == "none" else method
        rows.append(f"W1 {shape}, {label}: {median:,.0f} tok/s (median of {counts[method]}){ratio}")
    return rows


def update_rows(logs: Path) -> list[str]:
    update = _load(logs / "fp8_update.json")
    if not update:
        return ["full update with quantization: missing (fp8_update.json not written)"]
    bf16 = update["median_s"]["none"]
    return [
        f"full update load, {'bf16' if method == 'none' else method}: {s * 1e3:.0f} ms"
        + ("" if method == "none" else f", {s / bf16:.2f}x bf16 (goal <= {UPDATE_GOAL}x)")
        for method, s in update["median_s"].items()
    ]


def parity_rows(logs: Path) -> list[str]:
    parity = _load(logs / "parity-fp8.json")
    if not parity:
        return ["parity: missing (parity-fp8.json not written)"]
    rows = []
    for name in PARITY_ROWS:
        s = parity["results"].get(name)
        if s is not None:
            rows.append(
                f"parity, {name}: mean |Δ| {s['mean_abs_diff']:.3g}, max {s['max_abs_diff']:.3g}, k3 KL "
                f"{s['k3_kl']:.3g}, {s['frac_outside']:.0%} of ratios outside [0.9, 1.1]"
            )
    return rows or [f"parity: none of {PARITY_ROWS} in parity-fp8.json"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", type=Path)
    logs = ap.parse_args().logs
    for line in w1_rows(logs, "w1_8b") + w1_rows(logs, "w1_30b") + update_rows(logs) + parity_rows(logs):
        print(line)


if __name__ == "__main__":
    main()
