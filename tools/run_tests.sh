#!/usr/bin/env bash
# The test command (README): the main suite, then the CUDA kernels under numba's simulator in their
# own process (NUMBA_ENABLE_CUDASIM must be set before numba is imported). With pytest-xdist
# installed (the dev extra) each suite runs on up to TINYLOOP_TEST_WORKERS processes (default: the
# CPU count, at most 4): the main suite a whole file per worker (module fixtures are built once,
# the Ray tests keep one cluster), the simulator suite test by test. pytest's exit code 5 ("no
# tests collected") counts as success for a selection that is legitimately empty. Simulator tests
# marked slow (whole-model multi-row runs) are left to manual runs:
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
workers=${TINYLOOP_TEST_WORKERS:-$("$PY" -c 'import os; print(min(4, len(os.sched_getaffinity(0))))' 2>/dev/null || echo 1)}
main_par=(); sim_par=()
if [ "$workers" -gt 1 ] && "$PY" -c 'import xdist' 2>/dev/null; then
  main_par=(-n "$workers" --dist loadfile)
  sim_par=(-n "$workers" --dist load)
fi
run "$PY" -m pytest -q ${main_par[@]+"${main_par[@]}"} "$@"
run env NUMBA_ENABLE_CUDASIM=1 "$PY" -m pytest -q ${sim_par[@]+"${sim_par[@]}"} -m "cudasim and not slow" tests/cuda
exit $status
