#!/usr/bin/env bash
# One device call for FP8 rollouts (issue 31), one H200: the FP8 GPU tests, W1 on the Qwen3-8B shape in bf16 / fp8
# (128x128 blocks) / fbgemm_fp8 (per channel), engines alternating for REPEATS rounds (median of their runs), the
# parity rows and the engine-side load time of a full update. Logs under $OUT; the table last. Device call:
#   run(command="bash benchmarks/gpu_fp8.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
if ! python3 -c "import zmq, msgspec, fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %h' 2>/dev/null | tee -a "$OUT/gpu.txt"
part() {  # part NAME LIMIT_S COMMAND... (SKIP="name ..." skips parts)
  local name=$1 limit=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) return 0 ;; esac
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"
  tail -n 15 "$OUT/$name.log"
}
part fp8_tests 150 python3 -m pytest -q tests/gpu/test_fp8_gpu.py -p no:cacheprovider
part w1_8b 300 python3 benchmarks/offline_generate.py --device cuda --preset qwen3-8b-shape --load-format dummy \
  --quantization none,fbgemm_fp8,fp8 --rounds "$REPEATS" --repeats 1
part parity 200 python3 benchmarks/parity.py --device cuda --scenarios lm_head,fp8 --trainer-dtype bfloat16 \
  --out "$OUT/parity-fp8.json"
part fp8_update 90 python3 benchmarks/fp8_update.py --device cuda --preset qwen3-8b-shape --repeats "$REPEATS"
echo "== summary"; cat "$OUT/rc.txt"
grep -h "^W1 LLM.generate" "$OUT/w1_8b.log" || true
