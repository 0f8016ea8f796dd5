#!/usr/bin/env bash
# One device call for the RL side: weight sync (W4: ipc, and nccl when two GPUs are present), the two-GPU test,
# train/inference parity (W6) and the demo over ipc on a GPU. Each part has its own time limit so that one that hangs
# does not take the others with it. Logs go to $OUT; the server's Python packages travel as wheels (see the device
# notes) when the image lacks them.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SUM=$OUT/summary.txt
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"  # for ensure_server_packages: rlserve's engine core needs pyzmq and msgspec
ensure_server_packages || exit 1
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $? ($name)" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-22}" "$OUT/$name.log"
}
if [ "$NGPU" -ge 2 ]; then
  part nccl_test 150 python3 -m pytest -q -x tests/gpu/test_nccl_two_gpus.py -p no:cacheprovider
  part w4_nccl 200 python3 benchmarks/weight_sync.py --backend nccl --buffer-mib 64 256 1024 --out "$OUT/w4_nccl.json"
fi
part w4_ipc 120 python3 benchmarks/weight_sync.py --backend ipc --updates 100 --out "$OUT/w4_ipc.json"
part w6_parity 200 python3 benchmarks/parity.py --device cuda \
  --scenarios lm_head,raw_vs_processed,prefix_cache,batch_invariant --out "$OUT/w6_parity.json"
part demo_ipc 180 python3 -m rlserve.cli demo --device cuda --backend ipc --steps 100 --out "$OUT/demo_ipc"
cat "$OUT/summary.txt"
