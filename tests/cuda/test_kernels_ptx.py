"""Every CUDA kernel compiles to PTX for sm_90 with the signatures its launcher uses (no GPU
needed). Kernels that call other @cuda.jit device functions make numba ask the current device
for its compute capability; without a GPU that lookup is answered with (9, 0) for the duration
of the test."""

from __future__ import annotations

import types

import numba
import pytest

if numba.config.ENABLE_CUDASIM:
    pytest.skip("PTX compilation is not available under the CUDA simulator",
                allow_module_level=True)

from numba import cuda  # noqa: E402


def _toolchain_error():
    try:
        def k(a):
            a[0] = 1.0
        cuda.compile_ptx(k, "void(float32[::1])", cc=(9, 0))
    except Exception as e:  # NVVM / NVRTC missing or unusable
        return f"{type(e).__name__}: {e}"
    return None


_ERR = _toolchain_error()
if _ERR:
    pytest.skip(f"NVVM/NVRTC not usable: {_ERR}", allow_module_level=True)

from tinyloop.cuda.kernels import _pdl, kernel_modules, matmul, ptx_signatures  # noqa: E402

MODULES = kernel_modules()
# every kernel, with matmul's plain variants and the pair epilogues that rope and swiglu fuse into it
SIGNATURES = ptx_signatures()


@pytest.fixture
def cc90_device(monkeypatch):
    # compile as for a Hopper device: with the programmatic-launch wait (kernels/_pdl.py)
    monkeypatch.setitem(_pdl._state, "enabled", True)
    if not cuda.is_available():
        import numba.cuda.dispatcher as dispatcher
        monkeypatch.setattr(dispatcher, "get_current_device",
                            lambda: types.SimpleNamespace(compute_capability=(9, 0)))


@pytest.mark.parametrize("name,fn,sig", SIGNATURES, ids=[s[0] for s in SIGNATURES])
def test_compiles_for_sm90(cc90_device, name, fn, sig):
    ptx, resty = cuda.compile_ptx(fn, sig, cc=(9, 0))
    assert ".target sm_90" in ptx
    assert ".entry" in ptx
    # Every kernel waits for its predecessor grid before its first global memory access, so a
    # programmatic graph edge (graphs.py) never lets it read or overwrite data still in use.
    wait = ptx.find("griddepcontrol.wait;")
    first = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global",
                                                       "red.global")) if i >= 0), default=len(ptx))
    assert 0 <= wait < first, f"{name}: griddepcontrol.wait missing or after a global access"
    if name.startswith("matmul_fast"):
        # 8-byte weight loads, butterfly shuffles, and the register accumulators kept out of
        # local memory (a local-memory spill would multiply the GEMV's cost).
        # (pipelined: the words come by cp.async into shared memory, and go out of it as 8 bytes)
        if "_pipe" in name:
            assert "cp.async.ca.shared.global" in ptx and "ld.shared.u64" in ptx
            assert "prefetch.global.L1" in ptx and "cp.async.wait_group" in ptx
        else:
            assert "ld.global.u64" in ptx or "ld.global.nc.u64" in ptx
        assert "shfl.sync.bfly" in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx
        # the L2 prefetch hint exactly where the launcher asks for it (three spans per row)
        assert ("cp.async.bulk.prefetch.L2.global" in ptx) == ("_prefetch_" in name)
        # a row tail's last-block pattern: the device-wide fence and the atomic arrival count
        tail = "_tail_" in name
        assert ("membar.gl" in ptx) == tail and ("atom.global.add" in ptx) == tail
    if name.startswith(("attention", "argmax_split")):
        # Per-lane arrays in registers, and the split combine's device-wide fence and atomic
        # arrival count (the "last block" pattern); the rows form combines its own splits: neither
        assert "ld.local" not in ptx and "st.local" not in ptx
        rows = name.endswith("_rows")
        assert ("membar.gl" in ptx) != rows and ("atom.global.add" in ptx) != rows
    if name.startswith("attention_int4"):
        # the int4 decode q * scale + zero keeps its two roundings (the codec reference's): the
        # product is an explicit mul.rn, which ptxas never contracts into an fma
        assert "mul.rn.f32" in ptx
    if name.startswith("sample"):
        # the rounds of logit loads held in registers (unrolled local arrays, no local memory);
        # the pick's sort stages of stride <= 32 as warp shuffles
        assert "ld.local" not in ptx and "st.local" not in ptx
        assert ("shfl.sync.bfly" in ptx) == (name == "sample_pick")
    if name.startswith("kv_store"):
        # rint half to even (cvt.rni), the warp max butterflies
        assert "cvt.rni.f32.f32" in ptx and "shfl.sync.bfly" in ptx
    if name.startswith("matmul_exact"):
        # integer tensor-core steps (mma kernels), rint half to even in float64 (staging), and
        # nothing in local memory; float64 is on purpose here (the exact numerics' terms)
        assert ("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32" in ptx) == ("_mma" in name)
        assert ("dp4a.u32.s32" in ptx) == ("_gemv" in name)
        if "_stage" in name or "_gemv" in name:
            assert "cvt.rni.s64.f64" in ptx or "cvt.rni.f64.f64" in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx
    elif name.startswith(("matmul", "rmsnorm", "norm_add", "attention", "swiglu", "add", "embed", "argmax", "rope",
                          "kv_store", "token_mask")):
        # No accidental float64 arithmetic (an untyped 0.0 literal promotes a float32 chain);
        # rope reads cos/sin from a float32 table (only sample uses float64, on purpose).
        assert ".f64" not in ptx, f"{name} uses float64 arithmetic"


def _sass_registers(ptx: str):
    """(registers a thread, spill store bytes) of `ptx` assembled for sm_90 by nvJitLink's ptxas."""
    import re
    nvjitlink = pytest.importorskip("cuda.bindings.nvjitlink")
    h = nvjitlink.create(2, ["-arch=sm_90", "-verbose"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "kernel")
        nvjitlink.complete(h)
        buf = bytearray(nvjitlink.get_info_log_size(h))
        nvjitlink.get_info_log(h, buf)
    finally:
        nvjitlink.destroy(h)
    log = buf.decode(errors="ignore")
    regs, spill = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    assert regs, log
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


MMA_SIGS = [s for s in SIGNATURES if s[0].startswith("matmul_exact_mma") and "_wide" not in s[0]
            and "_groups" not in s[0]]
WIDE_SIGS = [s for s in SIGNATURES if s[0].startswith("matmul_exact_mma_wide")]
GROUP_SIGS = [s for s in SIGNATURES if s[0].startswith("matmul_exact_mma_groups")]


@pytest.mark.parametrize("name,fn,sig", MMA_SIGS, ids=[s[0] for s in MMA_SIGS])
def test_exact_mma_blocks_fit_the_register_file(cc90_device, name, fn, sig):
    # the launcher's warps per block (mma_warps) times the kernel's registers must fit an SM's
    # 64K registers, or the launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
    from tinyloop.cuda.kernels import matmul_exact as mx
    NTT, NCH, GS = (int(v) for v in name.rsplit("_", 3)[1:])
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    regs, spill = _sass_registers(ptx)
    assert spill == 0, f"{name}: {spill} bytes spilled"
    warps = mx.mma_warps(NCH, NTT)
    # registers are allocated per warp in units of 256
    assert warps * -(-regs * 32 // 256) * 256 <= 65536, (name, regs, warps)
    assert mx.mma_warps(44, NTT) * -(-regs * 32 // 256) * 256 <= 65536, (name, regs)


@pytest.mark.parametrize("name,fn,sig", GROUP_SIGS, ids=[s[0] for s in GROUP_SIGS])
def test_exact_group_mma_blocks_fit_the_register_file(cc90_device, name, fn, sig):
    # the one-tile kernel with a warp per group launches MMA_GROUP_NW warps a block
    from tinyloop.cuda.kernels import matmul_exact as mx
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    regs, spill = _sass_registers(ptx)
    assert spill == 0, f"{name}: {spill} bytes spilled"
    assert mx.MMA_GROUP_NW * -(-regs * 32 // 256) * 256 <= 65536, (name, regs)


@pytest.mark.parametrize("name,fn,sig", WIDE_SIGS, ids=[s[0] for s in WIDE_SIGS])
def test_exact_wide_mma_blocks_fit_the_register_file(cc90_device, name, fn, sig):
    # the wide kernel's block (MMA_WIDE_NW warps) must launch, and two blocks should share an SM
    from tinyloop.cuda.kernels import matmul_exact as mx
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    regs, spill = _sass_registers(ptx)
    assert spill == 0, f"{name}: {spill} bytes spilled"
    assert 2 * mx.MMA_WIDE_NW * -(-regs * 32 // 256) * 256 <= 65536, (name, regs)


def test_every_module_lists_signatures():
    import pathlib
    kernel_dir = pathlib.Path(matmul.__file__).parent
    files = {p.stem for p in kernel_dir.glob("*.py") if not p.stem.startswith("_")}
    assert {m.__name__.rsplit(".", 1)[1] for m in MODULES} == files
    assert all(m.ptx_signatures() for m in MODULES)
