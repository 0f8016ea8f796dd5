# Shared by the one-call GPU scripts (gpu_server.sh, gpu_session.sh): sourced after they set OUT, LOGS, ARCHIVE,
# BUDGET_S, SKIP, T0 and SUM. Each part runs under a time limit that never passes the call's budget; the logs so far
# travel back in $OUT/$ARCHIVE after every part, so that a run cut off still returns them.

pack() {  # the logs so far, to $OUT (at most 8 files come back: one archive and the summary)
  tar czf "$OUT/$ARCHIVE.part" -C "$LOGS" . 2>/dev/null && mv "$OUT/$ARCHIVE.part" "$OUT/$ARCHIVE"
  cp "$SUM" "$OUT/summary.txt"
}

KNOWN_PIDS=" "  # GPU processes not to wait for: there before the run, or seen surviving a kill
gpu_pids() {  # the processes on the GPU now, less the known ones
  local p
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -dc '0-9\n'); do
    case "$KNOWN_PIDS" in *" $p "*) ;; *) echo "$p" ;; esac
  done
}
KNOWN_PIDS=" $(gpu_pids | tr '\n' ' ')"

settle() {  # wait for what the part left on the GPU to go (up to 15 s); kill what stays, by pid
  local name=$1 left p
  for _ in $(seq 15); do
    [ -z "$(gpu_pids)" ] && return
    sleep 1
  done
  left=$(gpu_pids | tr '\n' ' ')
  echo "   GPU still in use after $name by pids $left: killed" | tee -a "$SUM"
  for p in $left; do kill -KILL "$p" 2>/dev/null; done
  sleep 2
  KNOWN_PIDS="$KNOWN_PIDS$(gpu_pids | tr '\n' ' ') "  # what a kill did not end: not waited for again
}

part() {  # part NAME SECONDS COMMAND...: the command, at most SECONDS and never past the budget
  local name=$1 limit=$2 left pid rc t
  shift 2
  case " $SKIP " in *" $name "*)
    echo "   skipped ($name): SKIP" | tee -a "$SUM"
    return 98
    ;;
  esac
  left=$((BUDGET_S - (SECONDS - T0)))
  if [ "$left" -lt 30 ]; then
    echo "   skipped ($name): ${left} s of the budget left" | tee -a "$SUM"
    return 99
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit} s, $((SECONDS - T0)) s into the run)"
  t=$SECONDS
  # timeout runs in a process group of its own and signals all of it; what is left in that group afterwards goes too.
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1 &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  echo "   exit $rc after $((SECONDS - t)) s ($name)" | tee -a "$SUM"
  grep -v "Loading weights\|Writing model" "$LOGS/$name.log" | tail -n "${TAIL:-12}"
  settle "$name"
  pack
  return $rc
}

SERVER_PACKAGES="fastapi, uvicorn, uvloop, httptools, zmq, msgspec, pydantic, httpx, prometheus_client"
ensure_server_packages() {  # the packages the image lacks (the core's ZMQ and msgspec too), from carried wheels
  python3 -c "import $SERVER_PACKAGES" 2>/dev/null && return 0
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "the image lacks the server's packages and no wheels came along: carry .whl (see the header)" | tee -a "$SUM"
    return 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  if ! python3 -c "import $SERVER_PACKAGES" 2>>"$SUM"; then
    echo "the carried wheels do not import (a dependency missing from .whl?): stopping before any part" | tee -a "$SUM"
    return 1
  fi
}

versions() {  # the software and the tree, for the log
  python3 -c "import torch, triton, fastapi, uvicorn, pydantic, zmq, msgspec; print('torch', torch.__version__, \
'triton', triton.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', \
pydantic.VERSION, 'pyzmq', zmq.__version__, 'libzmq', zmq.zmq_version(), 'msgspec', msgspec.__version__)"
  git log -1 --format='commit %h %s' 2>/dev/null
}
