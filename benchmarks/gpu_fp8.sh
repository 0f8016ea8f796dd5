#!/usr/bin/env bash
# FP8 rollouts (issue 31), one H200: the figures its "done when" asks for, FP8 against bf16 in the same call, then the
# table (benchmarks/fp8_table.py) last:
#   - w1_8b: W1 on the Qwen3-8B shape (bf16 / fp8 128x128 blocks; METHODS_8B=none,fp8,fbgemm_fp8 adds per-channel),
#     random weights (--load-format dummy), one engine per method with REPEATS timed runs after a warm-up (the median);
#   - fp8_update: the engine-side load of a full bf16 update into bf16 and FP8 models (medians of REPEATS);
#   - parity: the rows of fp8 as loaded and after 10 updates against the HF bf16 trainer, and bf16's.
#     run(command="bash benchmarks/gpu_fp8.sh", carry=[".whl"], timeout_s=600)
# W1 on the Qwen3-30B-A3B shape (bf16 / fp8) takes a call of its own: on an H100 (2026-12-07) its bf16 engine's four
# runs took 40 s each and the two engines about 310 s, which does not fit beside the parts above:
#     run(command="ONLY=w1_30b bash benchmarks/gpu_fp8.sh", carry=[".whl"], timeout_s=600)
# The FP8 GPU tests (GEMMs and the fused activation kernel against the reference, the FP8 fused MoE, updates under
# CUDA graphs, dense and MoE) and where a projection's time goes (fp8_gemm.py: bf16 GEMM, quantization, scaled GEMM)
# are a third call:
#     run(command="ONLY='fp8_tests fp8_gemm' bash benchmarks/gpu_fp8.sh", carry=[".whl"], timeout_s=600)
# One MoE layer of the 30B shape by component against each one's floor, bf16 then fp8 (moe_layer_profile.py; issue
# 32's per-component table, and where FP8's MoE time goes): ONLY=moe_profile (GPU only; SMOKE skips it).
# Each part has its own time limit (a call's parts add up to under 600 s; a part cut off keeps what it wrote: the W1
# parts write after every engine); ONLY="part ..." runs just those, SKIP="part ..." leaves parts out.
# CPU smoke (tests/benchmarks/test_benchmark_scripts.py): SMOKE=1 runs the parts on tiny presets on the CPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
REPEATS=${REPEATS:-3}
METHODS_8B=${METHODS_8B:-none,fp8}
mkdir -p "$OUT"
if [ "${SMOKE:-0}" = 1 ]; then
  DEVICE=cpu PRESET_8B=tiny-fp8 PRESET_30B=tiny-moe-fp8 SCALE=0.01 TESTS=tests/model/test_fp8.py
  PARITY_ARGS=(--device cpu --preset tiny-fp8 --scenarios fp8 --num-prompts 2 --prompt-len 8 --max-tokens 4)
else
  DEVICE=cuda PRESET_8B=qwen3-8b-shape PRESET_30B=qwen3-30b-a3b-shape SCALE=1
  TESTS="tests/gpu/test_fp8_gpu.py tests/gpu/test_moe_gpu.py"
  PARITY_ARGS=(--device cuda --scenarios lm_head,fp8 --trainer-dtype bfloat16)
  if ! python3 -c "import zmq, msgspec, fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
fi
git log -1 --format='commit %h' 2>/dev/null | tee -a "$OUT/gpu.txt"
: >"$OUT/rc.txt"
ONLY=${ONLY:-w1_8b fp8_update parity}
part() {  # part NAME LIMIT_S COMMAND... (runs parts named in ONLY and not in SKIP)
  local name=$1 limit=$2; shift 2
  case " $ONLY " in *" $name "*) ;; *) return 0 ;; esac
  case " ${SKIP:-} " in *" $name "*) return 0 ;; esac
  echo "== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name rc=$?" | tee -a "$OUT/rc.txt"
  tail -n 8 "$OUT/$name.log"
}
w1() {  # w1 NAME LIMIT_S PRESET METHODS
  part "$1" "$2" python3 benchmarks/offline_generate.py --device "$DEVICE" --preset "$3" --load-format dummy \
    --scale "$SCALE" --quantization "$4" --rounds 1 --repeats "$REPEATS" --out "$OUT/$1.json"
}
# shellcheck disable=SC2086  # TESTS is a list of files
part fp8_tests 450 python3 -m pytest -q $TESTS -p no:cacheprovider
part fp8_gemm 120 python3 benchmarks/fp8_gemm.py
if [ "$DEVICE" = cuda ]; then
  part moe_profile 200 python3 benchmarks/moe_layer_profile.py --quantization none fp8
fi
w1 w1_8b 190 "$PRESET_8B" "$METHODS_8B"
w1 w1_30b 420 "$PRESET_30B" none,fp8
part fp8_update 45 python3 benchmarks/fp8_update.py --device "$DEVICE" --preset "$PRESET_8B" --repeats "$REPEATS" \
  --out "$OUT/fp8_update.json"
part parity 240 python3 benchmarks/parity.py "${PARITY_ARGS[@]}" --out "$OUT/parity-fp8.json"
echo "== summary"
cat "$OUT/rc.txt"
case " $ONLY " in *" w1_"* | *" fp8_update "* | *" parity "*) python3 benchmarks/fp8_table.py "$OUT" ;; esac
