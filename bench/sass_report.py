"""Registers, spills and instruction mix of the CUDA kernels, without a GPU.

Compiles kernels to PTX with numba (as the PTX tests do), assembles them for sm_90 with `ptxas`
and disassembles the cubin with `cuobjdump -sass`, then prints per kernel: registers per thread,
spill bytes, static shared memory, SASS instruction count, and the count of chosen opcodes
(global / shared loads and stores, barriers, FFMA, integer logic). Register counts read this way
equal what the H200 reports for the loaded kernels (`regs_per_thread`: 64 for the R = 2 q4 GEMV,
152 for the wide one), so register blow-ups of a kernel change show before any device time is spent.

    python bench/sass_report.py matmul_fast_norm_q4_1_2_8_4096 attention
    python bench/sass_report.py --list

Arguments select kernels by substring of the names in `tinyloop.cuda.kernels.ptx_signatures()`
(default: the one-row q4 matmuls). Needs `ptxas` (CUDA toolkit) and `cuobjdump` with its
`nvdisasm` (toolkit, or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`; `--cuobjdump PATH`). numba's NVVM may emit a newer PTX ISA
version than the local ptxas accepts; `--ptx-version 9.0` rewrites the version line (the kernels
use no newer instructions), the default being to try as emitted and retry with 9.0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OPCODES = ("LDG", "STG", "LDS", "STS", "BAR", "SHFL", "FFMA", "FADD", "LOP3", "SHF", "PRMT", "IMAD")
DEFAULT = ("matmul_fast_q4_1_", "matmul_fast_norm_q4_1_")


def _tool(name: str, given: str | None) -> str:
    path = given or shutil.which(name)
    if not path:
        sys.exit(f"error: {name} not found (install the CUDA toolkit; cuobjdump also comes with "
                 f"`pip install nvidia-cuda-cuobjdump`, then pass --cuobjdump PATH)")
    return path


def _assemble(ptxas: str, ptx: str, workdir: str, name: str, version: str | None, maxreg: int = 0):
    """(ptxas -v output, cubin path); retries with `.version 9.0` when the ISA is too new."""
    src = os.path.join(workdir, f"{name}.ptx")
    cubin = os.path.join(workdir, f"{name}.cubin")
    for attempt in ((version,) if version else (None, "9.0")):
        text = ptx if attempt is None else re.sub(r"^\.version \d+\.\d+", f".version {attempt}", ptx,
                                                  flags=re.M)
        Path(src).write_text(text)
        cap = [f"-maxrregcount={maxreg}"] if maxreg else []
        r = subprocess.run([ptxas, "-arch=sm_90", "-O3", "-v", *cap, src, "-o", cubin],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return r.stderr, cubin
    sys.exit(f"error: ptxas failed for {name}:\n{r.stderr.strip()}")


def report(name: str, fn, sig: str, ptxas: str, cuobjdump: str, workdir: str, version=None,
           maxreg: int = 0, dump: str | None = None) -> dict:
    from numba import cuda
    ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
    info, cubin = _assemble(ptxas, ptx, workdir, name, version, maxreg)

    def num(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    # cuobjdump runs nvdisasm, which pip's nvidia-cuda-nvdisasm puts beside pip's cuobjdump
    env = {**os.environ, "PATH": os.path.dirname(os.path.abspath(cuobjdump)) + os.pathsep + os.environ.get("PATH", "")}
    done = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"error: cuobjdump -sass failed: {done.stderr.strip()} (nvdisasm: `pip install "
                 f"nvidia-cuda-nvdisasm`)")
    sass = done.stdout
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{name}.sass").write_text(sass)
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", sass)]
    hist = collections.Counter(ops)
    return {"kernel": name, "registers": num(r"Used (\d+) registers"),
            "spill_stores": num(r"(\d+) bytes spill stores"), "spill_loads": num(r"(\d+) bytes spill loads"),
            "smem": num(r"(\d+) bytes smem"), "instructions": len(ops),
            "opcodes": {k: hist.get(k, 0) for k in OPCODES}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("select", nargs="*", help="substrings of kernel names (default: one-row q4 matmuls)")
    ap.add_argument("--list", action="store_true", help="list the kernel names and exit")
    ap.add_argument("--ptxas")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--ptx-version", help="rewrite the PTX .version line to this (e.g. 9.0)")
    ap.add_argument("--maxrregcount", type=int, default=0,
                    help="register cap per thread, as the launcher's max_registers (matmul "
                         "GEMV_XWIDE_CONFIG: 128)")
    ap.add_argument("--json")
    ap.add_argument("--dump", help="also write each kernel's SASS to DIR/<kernel>.sass")
    args = ap.parse_args(argv)
    if args.maxrregcount and not 16 <= args.maxrregcount <= 255:
        ap.error(f"--maxrregcount={args.maxrregcount} must be 0 (no cap) or in [16, 255]")

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    if not cuda.is_available():
        # kernels that call device functions ask the current device for its compute capability
        dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    from tinyloop.cuda.kernels import ptx_signatures
    sigs = ptx_signatures()
    if args.list:
        print("\n".join(s[0] for s in sigs))
        return 0
    select = args.select or DEFAULT
    chosen = [s for s in sigs if any(p in s[0] for p in select)]
    if not chosen:
        ap.error(f"no kernel name contains any of {select} (see --list)")
    ptxas = _tool("ptxas", args.ptxas)
    cuobjdump = _tool("cuobjdump", args.cuobjdump)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, fn, sig in chosen:
            rows.append(report(name, fn, sig, ptxas, cuobjdump, work, args.ptx_version, args.maxrregcount,
                               args.dump))
    head = f"{'kernel':48} {'regs':>5} {'spill':>6} {'smem':>6} {'instr':>6}  " + " ".join(f"{k:>5}" for k in OPCODES)
    print(head)
    for r in rows:
        spill = r["spill_stores"] + r["spill_loads"]
        print(f"{r['kernel'][:48]:48} {r['registers']:5d} {spill:6d} {r['smem']:6d} {r['instructions']:6d}  "
              + " ".join(f"{r['opcodes'][k]:5d}" for k in OPCODES))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
