"""The backend conformance suite (tests/backend_conformance.py) on the CPU backend."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("backend_conformance")

from backend_conformance import *  # noqa: E402,F401,F403  (the suite's tests and fixtures)

from tinyloop.cpu.backend import CPUBackend  # noqa: E402


@pytest.fixture(scope="module")
def backend_factory():
    return CPUBackend
