"""Programmatic dependent launch (Hopper, compute capability 9.0 and later).

In a captured decode step every kernel depends on the one before it. With default graph edges a
kernel is launched only once its predecessor has completed and its writes have been flushed; each
of the ~50 launches of a step pays that hand-over in series. `graphs.Graph` can instead mark the
kernel -> kernel edges *programmatic*: the dependent grid may then be launched before its
predecessor's completion has been fully processed, and must itself wait, with
``griddepcontrol.wait``, until the predecessor has completed and its memory operations are
visible. Every kernel of this package therefore starts with ``grid_dep_wait()``, before it reads
or writes anything another kernel touches (the PTX tests check that the wait precedes every global
access). A kernel completes only after its own wait returned, so the ordering is transitive:
results are exactly those of default edges. Outside such an edge (eager launches, default edges)
the wait returns at once.

No kernel executes ``griddepcontrol.launch_dependents``, so a dependent grid is scheduled once
every block of its predecessor has exited, not earlier. Measured on the H200 (360m, L = 8,
bench/profile_decode.py, same session): default edges 0.483 ms/token, programmatic edges
0.476 / 0.475; with launch_dependents as each kernel's second statement (the dependent's blocks
resident while the predecessor runs) 0.611 ms/token, against 0.485 with default edges in that run.

The instruction exists from PTX for sm_90 on; it is emitted when the kernel is compiled for a
device of compute capability 9.0 or later (`enabled`, decided at the first compilation) and
``TINYLOOP_CUDA_PDL`` is not "0" (then the graphs keep default edges too). Under the simulator it
is a plain no-op.
"""

from ...runtime.config import env_switch
from ._common import SIM

#: Smallest compute capability with griddepcontrol.
MIN_CC = (9, 0)

_state = {"enabled": None}


def enabled() -> bool:
    """Whether kernels compiled in this process carry ``griddepcontrol.wait`` (and captured graphs
    get programmatic edges): TINYLOOP_CUDA_PDL on, not the simulator, and the current device of
    compute capability >= MIN_CC. Decided once, at the first call."""
    if _state["enabled"] is None:
        on = env_switch("TINYLOOP_CUDA_PDL") and not SIM
        if on:
            try:
                from numba import cuda
                on = tuple(cuda.get_current_device().compute_capability) >= MIN_CC
            except Exception:      # no device (PTX compile tests, CI): nothing emitted
                on = False
        _state["enabled"] = on
    return bool(_state["enabled"])


try:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic
except ImportError:        # a numba-cuda without CUDA intrinsics: no programmatic launch
    intrinsic = None
    _state["enabled"] = False

if SIM or intrinsic is None:
    from numba import cuda

    @cuda.jit(device=True)
    def grid_dep_wait():
        """No-op (the simulator, or a numba-cuda that cannot emit the instruction)."""

else:
    def _wait_codegen(context, builder, sig, args):
        if enabled():
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(ir.InlineAsm(fnty, "griddepcontrol.wait;", "~{memory}", side_effect=True), [])
        return context.get_dummy_value()

    @intrinsic
    def grid_dep_wait(typingctx):
        """``griddepcontrol.wait``: block until the prerequisite grid has completed and its memory
        operations are visible (returns at once without a programmatic prerequisite)."""
        return types.void(), _wait_codegen
