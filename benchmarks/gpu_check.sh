#!/usr/bin/env bash
# One device call: GPU tests, kernel checks, the throughput table, W1 in batch-invariant mode and W5 (SKIP_W5=1 skips
# it). Logs go to $OUT. Where the image lacks rlserve's packages (pyzmq, msgspec, the server's), carry them as .whl.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SUM=$OUT/summary.txt
# shellcheck source=benchmarks/gpu_lib.sh
. "$(dirname "$0")/gpu_lib.sh"  # for ensure_server_packages: rlserve's engine core needs pyzmq and msgspec
ensure_server_packages || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -x tests/gpu tests/model/kernels/test_paged_attention.py -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/tests.log"
if [ -f benchmarks/attention_kernels.py ]; then
  python3 benchmarks/attention_kernels.py --quick 2>&1 | tail -n 30 | tee "$OUT/kernels.log"
fi
python3 benchmarks/throughput.py --device cuda --preset qwen3-0.6b-shape ${THROUGHPUT_ARGS:-} --out "$OUT/throughput.json" 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$OUT/throughput.log"
python3 benchmarks/throughput.py --device cuda --preset qwen3-0.6b-shape --workloads W1 --hf none --batch-invariant \
  --out "$OUT/throughput_bi.json" 2>&1 | grep -v "Loading weights\|Writing model" | tail -n 3 | tee "$OUT/throughput_bi.log"
if [ -z "${SKIP_W5:-}" ]; then
  python3 benchmarks/async_updates.py --device cuda 2>&1 | grep -v "Loading weights\|Writing model" | tail -n 8 | tee "$OUT/w5.log"
fi
