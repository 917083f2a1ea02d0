"""The on-disk cache of compiled kernels: `jit_kernel` is ``cuda.jit`` for this package's kernels,
with numba-cuda's file cache turned on, so a process after the first loads the compiled kernels
instead of compiling them again (the first request's time is mostly compilation).

Where: ``$TINYLOOP_KERNEL_CACHE`` or ``~/.cache/tinyloop``, in a folder named after a hash of every
source file of this package (kernels call device functions of other files, whose changes numba's
own key -- the kernel file's stamp, its bytecode, its closure values, the numba-cuda version --
would not see; any change to any kernel source starts a fresh folder). numba's
``config.CACHE_DIR`` is set only while each kernel's cache is made, so other numba users in the
process keep theirs. Kernels that link files (exit_probe.py's, which call the device runtime)
cannot be cached and keep ``cuda.jit``. ``TINYLOOP_KERNEL_CACHE=0`` turns it off, and so does a folder that cannot
be written; the simulator never caches.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import tempfile

from numba import config, cuda

from ._common import SIM

_state = {"dir": None}


def cache_dir():
    """The folder kernels are cached in, or None when caching is off."""
    if _state["dir"] is None:
        where = os.environ.get("TINYLOOP_KERNEL_CACHE", "")
        if SIM or where == "0":
            _state["dir"] = ""
        else:
            h = hashlib.sha256()
            for p in sorted(pathlib.Path(__file__).parent.glob("*.py")):
                h.update(p.name.encode() + b"\0" + p.read_bytes())
            root = where or os.path.join(os.path.expanduser("~"), ".cache", "tinyloop")
            path = os.path.join(root, "kernels-" + h.hexdigest()[:16])
            try:
                # numba writes the cache while a kernel compiles, where an error would fail
                # the launch: a folder that cannot be written turns caching off instead
                os.makedirs(path, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
            except OSError:
                path = ""
            _state["dir"] = path
    return _state["dir"] or None


@contextlib.contextmanager
def _cache_dir_set(path):
    old = config.CACHE_DIR
    config.CACHE_DIR = path
    try:
        yield
    finally:
        config.CACHE_DIR = old


def _cached(dispatcher):
    path = cache_dir()
    if path is not None and hasattr(dispatcher, "enable_caching"):
        with _cache_dir_set(path):
            dispatcher.enable_caching()
    return dispatcher


def jit_kernel(fn=None, **options):
    """``@jit_kernel`` / ``@jit_kernel(**options)``: ``cuda.jit`` with the kernel file cache."""
    if fn is None:
        return lambda f: _cached(cuda.jit(**options)(f))
    return _cached(cuda.jit(fn))
