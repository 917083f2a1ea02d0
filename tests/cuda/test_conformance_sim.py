"""The backend conformance suite (tests/backend_conformance.py) on the CUDA backend under numba's
CUDA simulator, with tiny shapes (the simulator runs every CUDA thread as a Python thread)::

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -m cudasim tests/cuda/test_conformance_sim.py -q

Marked slow (tens of minutes on two cores): tools/run_tests.sh leaves it out of CI, where the
CPU runner and the simulator kernel tests run; run it by hand as above.
"""

from __future__ import annotations

import numba
import pytest

pytestmark = [pytest.mark.cudasim, pytest.mark.slow]

from numba import cuda  # noqa: E402

if not numba.config.ENABLE_CUDASIM and not cuda.is_available():
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) or a CUDA GPU",
                allow_module_level=True)

pytest.register_assert_rewrite("backend_conformance")

from backend_conformance import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)

from conftest import TINY  # noqa: E402

#: As small as the kernels and the suite allow: head_dim 16, GQA 2:1, d_model >= 6 probe rows,
#: vocab > 11 (the tie probes), groups of 16 for the quantized weights.
SIM_DIMS = dict(TINY, vocab_size=32, d_model=32, n_heads=2, n_kv_heads=1, d_ff=16, n_pre=1, n_loop=1,
                n_post=0, default_loops=1)


@pytest.fixture(scope="module")
def conformance_dims():
    return dict(SIM_DIMS)


@pytest.fixture(scope="module")
def conformance_quick():
    return True


@pytest.fixture(scope="module")
def backend_factory():
    from tinyloop.cuda.backend import CUDABackend
    return CUDABackend
