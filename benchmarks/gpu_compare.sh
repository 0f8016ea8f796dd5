#!/usr/bin/env bash
# One device call: the GPU tests of this tree, then W1 (benchmarks/offline_generate.py, qwen3-0.6b-shape, W1's tuned
# engine, core in its own process) on this tree and on another (BASE, e.g. a `git archive` of the last commit before a
# change, carried as an ignored folder), engines alternating for ROUNDS rounds, one warm-up and one timed run each:
# the change's cost as medians taken in one call. Logs under $OUT; the table last. Device call:
#   run(command="BASE=.base bash benchmarks/gpu_compare.sh", carry=[".whl", ".base"], timeout_s=600)
# W7=1 adds W7 on both trees after W1 (benchmarks/server_throughput.py, W7's shape: the default server non-streaming
# and streaming, W7_REPEATS runs each against its own offline W1, base first): with TESTS= it fits one call. W7 alone,
# with more runs per tree: ROUNDS=0 TESTS= W7=1 W7_REPEATS=5.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BASE=${BASE:-.base}
ROUNDS=${ROUNDS:-3}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-qwen3-0.6b-shape}
SCALE=${SCALE:-1}
TESTS=${TESTS-tests/gpu}
W7_PROMPTS=${W7_PROMPTS:-1024}
W7_LEN=${W7_LEN:-256}
W7_REPEATS=${W7_REPEATS:-3}
mkdir -p "$OUT"
if ! python3 -c "import zmq, msgspec, fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
SITE=${PYTHONPATH:-}
if [ -n "$TESTS" ]; then
  PYTHONPATH=$PWD${SITE:+:$SITE} timeout 200 python3 -m pytest -q $TESTS -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?: $(tail -n 1 "$OUT/gpu_tests.log")" | tee "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"
fi
MODEL=$(mktemp -d)/model
PYTHONPATH=$PWD${SITE:+:$SITE} python3 -c "import sys, torch; from rlserve.toy import make_model_dir; \
make_model_dir(sys.argv[1], preset=sys.argv[2], dtype=torch.bfloat16 if sys.argv[3] == 'cuda' else torch.float32)" \
  "$MODEL" "$PRESET" "$DEVICE" >/dev/null 2>&1
w1() {  # w1 TREE LABEL
  (cd "$1" && PYTHONPATH=$PWD${SITE:+:$SITE} timeout 150 python3 benchmarks/offline_generate.py --device "$DEVICE" \
    --model-dir "$MODEL" --scale "$SCALE" --repeats 1) >"$OUT/w1_$2_$r.log" 2>&1
  grep -F "(timed)" "$OUT/w1_$2_$r.log" | sed -E "s/.*: ([0-9,.]+) tok\/s/\1/" | tr -d , | sed "s/^/$2 /" >>"$OUT/w1_runs.txt"
}
for r in $(seq "$ROUNDS"); do
  w1 "$BASE" base
  w1 . tree
done
w7() {  # w7 TREE LABEL
  (cd "$1" && PYTHONPATH=$PWD${SITE:+:$SITE} timeout 280 python3 benchmarks/server_throughput.py --device "$DEVICE" \
    --model-dir "$MODEL" --num-prompts "$W7_PROMPTS" --input-len "$W7_LEN" --output-len "$W7_LEN" \
    --repeats "$W7_REPEATS" --variant= --variant=stream) >"$OUT/w7_$2.log" 2>&1
  grep -h "^| offline\|^| server" "$OUT/w7_$2.log" | sed "s/^/W7 $2 /" | tee -a "$OUT/summary.txt"
}
if [ "${W7:-0}" = 1 ]; then
  w7 "$BASE" base
  w7 . tree
fi
[ -s "$OUT/w1_runs.txt" ] || exit 0  # ROUNDS=0: no W1 to summarise
python3 - "$OUT/w1_runs.txt" <<'PY' | tee -a "$OUT/summary.txt"
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    label, value = line.split()
    runs.setdefault(label, []).append(float(value))
base = statistics.median(runs.get("base", [float("nan")]))
for label, values in runs.items():
    m = statistics.median(values)
    print(f"W1 {label}: median {m:,.0f} tok/s of {len(values)} ({min(values):,.0f}-{max(values):,.0f}), {m / base:.3f}x base")
PY
