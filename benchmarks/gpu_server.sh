#!/usr/bin/env bash
# One device call for the engine core in its own process (ZMQ + msgspec between front end and core), on one H200,
# model qwen3-0.6b-shape in bf16 (random weights, built once here and shared by the parts):
#   startup_cold       seconds from starting `rlserve serve` to its first served completion (benchmarks/startup_time.py)
#                      on a cold Triton cache; startup_inproc and startup_warm (core in process / own process) at the end.
#   w1_mp, w1_inproc   W1 through `LLM.generate` (benchmarks/offline_generate.py), the core in its own process (the
#                      default) and in the caller's (RLSERVE_ENABLE_MULTIPROCESSING=0), in the same run (W7's
#                      offline row is w1_mp again: SKIP="w1_mp w1_inproc" saves their time).
#   w7_ceiling         W7's clients against a server that answers at once (benchmarks/w7_client_ceiling.py): their
#                      own ceiling, non-streaming and streaming, so that W7 is known to measure the server.
#   w7                 W7 server vs offline (benchmarks/server_throughput.py, 1024 x 256 in / 256 out) for each
#                      server set-up in W7_VARIANTS (';'-separated `--variant` specs), against one offline figure:
#                      by default non-streaming and streaming with one API server, then with four, then four
#                      streaming 4 tokens per chunk. PROFILE=1 adds w7_profile: W7 under py-spy (every process
#                      sampled; PROFILE_ARGS: its --variant spec, e.g. "stream") and startup_profile (start-up
#                      under py-spy, every process).
#   demo_ipc, w4_ipc   the ipc demo (40 steps): sync and pause per step; weight_sync.py over ipc (100 updates).
# Each part has its own time limit, and none runs past BUDGET_S (default 540) from the script's start: a part that would
# is cut to what is left, and one with less than 30 s left is skipped. SKIP="w4_ipc demo_ipc ..." skips parts by name.
# Logs go to /tmp/gpu_server (LOGS) and travel back as $OUT/gpu_server_logs.tgz, re-packed after every part so a cut-off
# run still returns them; $OUT/summary.txt and the end of the output hold the summary.
# The server's Python packages travel as wheels when the image lacks them. Device call:
#   run(command="bash benchmarks/gpu_server.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_server}
BUDGET_S=${BUDGET_S:-540}
W7_VARIANTS=${W7_VARIANTS:-;stream;--api-server-count=4;stream --api-server-count=4;stream --api-server-count=4 --stream-interval=4}
W7_REPEATS=${W7_REPEATS:-1}
SKIP=${SKIP:-}
# For a smoke test elsewhere: DEVICE=cpu DTYPE=float32 PRESET=tiny W1_SCALE=0.01 NUM_PROMPTS=16 SEQ_LEN=16.
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PRESET=${PRESET:-qwen3-0.6b-shape}
W1_SCALE=${W1_SCALE:-1}
NUM_PROMPTS=${NUM_PROMPTS:-1024}
SEQ_LEN=${SEQ_LEN:-256}
T0=$SECONDS
mkdir -p "$OUT" "$LOGS"
SUM=$LOGS/summary.txt
: >"$SUM"

ARCHIVE=gpu_server_logs.tgz
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"

nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
if ! ensure_server_packages; then
  pack
  exit 1
fi
versions | tee -a "$LOGS/gpu.txt"
git status --short 2>/dev/null | head -n 30 >>"$LOGS/gpu.txt"

# The model, once (bf16, as every part below runs it); a part builds its own if this fails.
MODEL=/tmp/rlserve-$PRESET-$DTYPE
MODEL_ARGS=()
if [ -f "$MODEL/config.json" ] || part model 150 python3 -c "import torch; from rlserve.toy import make_model_dir
print(make_model_dir('$MODEL', preset='$PRESET', dtype=torch.$DTYPE))"; then
  MODEL_ARGS=(--model-dir "$MODEL")  # a second run in the same call reuses it
fi

# The server logs at info: the engine's start-up phases (model load, CUDA graphs, warm-up) are in the server logs.
STARTUP=(python3 benchmarks/startup_time.py --device "$DEVICE" --preset "$PRESET" --dtype "$DTYPE"
  ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} --serve-arg=--log-level=info)
# First, on a cold Triton cache, as a fresh machine starts; again at the end, warm, beside the core in process.
part startup_cold 100 "${STARTUP[@]}" --timeout 90 --log "$LOGS/startup_cold_server.log" --out "$LOGS/startup_cold.json"
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
if [ -n "${PROFILE:-}" ] && [ -x "$SPY" ]; then
  # Where start-up goes in every process (the core's model load took 7 s against 0.5 s in process, 2026-12-01).
  part startup_profile 90 "$SPY" record --subprocesses --rate 100 --format raw -o "$LOGS/startup_profile.txt" -- \
    "${STARTUP[@]}" --timeout 80 --log "$LOGS/startup_profile_server.log"
fi

W7=(python3 benchmarks/server_throughput.py --device "$DEVICE" --preset "$PRESET" --dtype "$DTYPE"
  --num-prompts "$NUM_PROMPTS" --input-len "$SEQ_LEN" --output-len "$SEQ_LEN" --repeats "$W7_REPEATS"
  ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"})
# The clients' own ceiling first (the same clients against a server that answers at once): W7 measures the server
# only where this is well above it.
part w7_ceiling 90 python3 benchmarks/w7_client_ceiling.py --num-prompts "$NUM_PROMPTS" --input-len "$SEQ_LEN" \
  --output-len "$SEQ_LEN" --repeats 3
IFS=';' read -r -a SPECS <<<"$W7_VARIANTS"
VARIANT_ARGS=()
for spec in "${SPECS[@]}"; do VARIANT_ARGS+=("--variant=$spec"); done
part w7 300 "${W7[@]}" "${VARIANT_ARGS[@]}"
# Where the time goes with the server (PROFILE=1): py-spy samples every process of the benchmark.
if [ -n "${PROFILE:-}" ] && [ -x "$SPY" ]; then
  part w7_profile 120 "$SPY" record --subprocesses --nonblocking --rate 50 --format raw -o "$LOGS/w7_profile.txt" -- \
    "${W7[@]}" "--variant=${PROFILE_ARGS:-}"
fi
W1=(python3 benchmarks/offline_generate.py --device "$DEVICE" --preset "$PRESET" --dtype "$DTYPE" --scale "$W1_SCALE"
  ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"})
part w1_mp 100 "${W1[@]}"
part w1_inproc 100 env RLSERVE_ENABLE_MULTIPROCESSING=0 "${W1[@]}"

part demo_ipc 110 python3 -m rlserve.cli demo --device "$DEVICE" --backend ipc --steps 40 --out "$LOGS/demo_ipc"
part w4_ipc 60 python3 benchmarks/weight_sync.py --backend ipc --updates 100 --out "$LOGS/w4_ipc.json"
part startup_inproc 60 env RLSERVE_ENABLE_MULTIPROCESSING=0 "${STARTUP[@]}" --timeout 55 \
  --log "$LOGS/startup_inproc_server.log" --out "$LOGS/startup_inproc.json"
part startup_warm 60 "${STARTUP[@]}" --timeout 55 --log "$LOGS/startup_warm_server.log" --out "$LOGS/startup_warm.json"

{
  echo
  echo "==== gpu_server.sh on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 || echo "no GPU"):" \
    "$DEVICE $PRESET $DTYPE, $((SECONDS - T0)) s in all"
  grep -h "^torch\|^commit" "$LOGS/gpu.txt"
  for name in w1_mp w1_inproc; do
    [ -f "$LOGS/$name.log" ] && grep -h "^engine start\|^W1 " "$LOGS/$name.log" | sed "s/^/$name: /"
  done
  [ -f "$LOGS/w7_ceiling.log" ] && grep -h "^| non-streaming\|^| streaming" "$LOGS/w7_ceiling.log" | sed "s/^/w7_ceiling: /"
  for name in w7 w7_profile; do
    [ -f "$LOGS/$name.log" ] && grep -h "^W7 server\|^| offline\|^| server\|^| mode .*us/token" "$LOGS/$name.log" | sed "s/^/$name: /"
  done
  [ -f "$LOGS/w4_ipc.log" ] && grep -h "ms per update" "$LOGS/w4_ipc.log" | sed "s/^/w4_ipc: /"
  for name in startup_cold startup_inproc startup_warm; do
    [ -f "$LOGS/$name.log" ] && grep -h "^startup" "$LOGS/$name.log" | sed "s/^/$name: /"
  done
  [ -f "$LOGS/w4_ipc.log" ] && grep -h "^  packed\|^unpacked" "$LOGS/w4_ipc.log" | sed "s/^/w4_ipc: /"
  [ -f "$LOGS/demo_ipc.log" ] && grep -h "^warm-up\|^reward" "$LOGS/demo_ipc.log" | sed "s/^/demo_ipc: /"
  [ -f "$LOGS/demo_ipc/log.json" ] && python3 -c "import json, statistics as st
s = json.load(open('$LOGS/demo_ipc/log.json'))['steps']
print('demo_ipc: sync ms median', round(st.median(x['sync_ms'] for x in s), 1), 'pause ms median',
      round(st.median(x['pause_ms'] for x in s), 1))"
  echo "exit codes (124: hit its limit; 98/99: skipped):"
  cat "$SUM"
} >"$LOGS/final.txt"
cp "$LOGS/final.txt" "$SUM.new" && mv "$SUM.new" "$SUM"
pack
cat "$SUM"
