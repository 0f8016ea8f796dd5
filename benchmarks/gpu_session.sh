#!/usr/bin/env bash
# One device call (<= 9 min) for issue 33's offline figures, medians of 3 runs in one call, model qwen3-0.6b-shape in
# bf16 (random weights, built once here and shared by the parts):
#   gpu_tests      tests/gpu/test_device_defaults_gpu.py: the batch limits an engine gets on this GPU (skipped on CPU).
#   w1_engines     W1 through `LLM.generate` (benchmarks/offline_generate.py), three engine set-ups alternating for 3
#                  rounds (an engine started per set-up and round, one warm-up and one timed run each): W1's tuned
#                  settings, `LLM(model)` defaults (the batch limits the device chooses), batch-invariant (tuned).
#   w4_ipc_1..3    W4 over ipc, a packed 1 GiB buffer (and the unpacked row), benchmarks/weight_sync.py, 3 runs.
#   w1_recording   W1 in throughput.py with the roofline's schedule recorded after the timed runs and inside them
#                  (W1,W1/inline, alternating, 3 runs each): what recording inside the step costs. Last: what the
#                  budget leaves it (its runs print as they end).
# The table (benchmarks/session_table.py) prints last. Each part has its own time limit and none runs past BUDGET_S
# (default 530) from the start; SKIP="w1_engines ..." skips parts by name. Logs go to /tmp/gpu_session (LOGS) and come
# back as $OUT/gpu_session_logs.tgz, re-packed after every part; $OUT/summary.txt holds the table and exit codes.
# The engine core's pyzmq and msgspec (and the server's packages) travel as wheels when the image lacks them:
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
# CPU smoke (tests/benchmarks): DEVICE=cpu DTYPE=float32 PRESET=tiny W1_SCALE=0.005 ROUNDS=1 W4_RUNS=1 \
#   W4_ARGS="--backend gloo --buffer-mib 4 --updates 2".
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_session}
ARCHIVE=gpu_session_logs.tgz
BUDGET_S=${BUDGET_S:-530}
SKIP=${SKIP:-}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PRESET=${PRESET:-qwen3-0.6b-shape}
W1_SCALE=${W1_SCALE:-1}
ROUNDS=${ROUNDS:-3}
W4_RUNS=${W4_RUNS:-3}
W4_ARGS=${W4_ARGS:---backend ipc --buffer-mib 1024 --updates 30}
T0=$SECONDS
mkdir -p "$OUT" "$LOGS"
SUM=$LOGS/summary.txt
: >"$SUM"
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"

nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv 2>&1 | tee "$LOGS/gpu.txt"
if ! ensure_server_packages; then
  pack
  exit 1
fi
versions 2>&1 | tee -a "$LOGS/gpu.txt"
git status --short 2>/dev/null | head -n 30 >>"$LOGS/gpu.txt"

MODEL=${MODEL:-/tmp/rlserve-$PRESET-$DTYPE}
MODEL_ARGS=(--preset "$PRESET")
if [ -f "$MODEL/config.json" ] || part model 150 python3 -c "import torch; from rlserve.toy import make_model_dir
print(make_model_dir('$MODEL', preset='$PRESET', dtype=torch.$DTYPE))"; then
  MODEL_ARGS=(--model-dir "$MODEL")
fi
part gpu_tests 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_device_defaults_gpu.py
part w1_engines 330 python3 benchmarks/offline_generate.py --device "$DEVICE" --dtype "$DTYPE" "${MODEL_ARGS[@]}" \
  --scale "$W1_SCALE" --engines tuned,defaults,batch-invariant --rounds "$ROUNDS" --repeats 1 --out "$LOGS/w1_engines.json"
read -r -a W4 <<<"$W4_ARGS"
for i in $(seq "$W4_RUNS"); do
  part "w4_ipc_$i" 60 python3 benchmarks/weight_sync.py "${W4[@]}" --out "$LOGS/w4_ipc_$i.json"
done
part w1_recording 150 python3 benchmarks/throughput.py --device "$DEVICE" --dtype "$DTYPE" "${MODEL_ARGS[@]}" \
  --scale "$W1_SCALE" --workloads W1,W1/inline --repeats "$ROUNDS" --hf none --out "$LOGS/w1_recording.json"

{
  echo
  echo "==== gpu_session.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo "no GPU"):" \
    "$DEVICE $PRESET $DTYPE, $((SECONDS - T0)) s in all"
  grep -h "^torch\|^commit" "$LOGS/gpu.txt"
  tail -n 1 "$LOGS/gpu_tests.log" 2>/dev/null | sed "s/^/gpu_tests: /"
  grep -h "batch limits for" "$LOGS/w1_engines.log" 2>/dev/null | sed "s/^.*device_defaults: //" | sort -u
  python3 benchmarks/session_table.py "$LOGS" 2>&1
  echo "exit codes (124: hit its limit; 98/99: skipped):"
  cat "$SUM"
} >"$LOGS/final.txt"
cp "$LOGS/final.txt" "$SUM.new" && mv "$SUM.new" "$SUM"
pack
cat "$SUM"
