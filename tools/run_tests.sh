#!/usr/bin/env bash
# The test command (README): the main suite, then the CUDA kernels under numba's simulator in their
# own process (NUMBA_ENABLE_CUDASIM must be set before numba is imported). pytest's exit code 5
# ("no tests collected") counts as success for a selection that is legitimately empty. Simulator
# tests marked slow (whole-model multi-row runs, minutes each) are left to manual runs:
#   NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
status=0
run() {
  "$@"
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=$rc; fi
}
run "$PY" -m pytest -q "$@"
run env NUMBA_ENABLE_CUDASIM=1 "$PY" -m pytest -q -m "cudasim and not slow" tests/cuda
exit $status
