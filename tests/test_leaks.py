"""Resource leaks a long-running server or batch job would hit: memory a freed model keeps while
its object is still referenced (by the caller, or by a closed HTTP app that a framework cache pins),
and process-wide grammar bookkeeping that grows with every model loaded and freed.

Each test compares the growth of N cycles with that of N more (after a warm-up), with generous
margins: a leak grows by a model's whole buffers (megabytes) per cycle, noise by kilobytes."""

from __future__ import annotations

import gc
import threading
import tracemalloc

import pytest

import tinyloop as tl

from conftest import write_tiny

P = [3, 17, 42, 8, 91, 23, 11, 60, 2, 77]
CFG = tl.GenerateConfig(max_tokens=4)
SEQ = 512            # the CPU workspace (attention scores) is ~5 MB at this max_seq_len


def _traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def _growth_per_cycle(cycle, n: int = 3) -> tuple:
    """(bytes per cycle over n cycles, then over n more), tracemalloc on; one warm-up cycle."""
    cycle()
    tracemalloc.start()
    try:
        a = _traced()
        for _ in range(n):
            cycle()
        b = _traced()
        for _ in range(n):
            cycle()
        c = _traced()
    finally:
        tracemalloc.stop()
    return (b - a) / n, (c - b) / n


def test_free_model_releases_the_buffers_of_a_model_object_still_referenced(tiny_path):
    """free_model frees the weights and the workspace now, not when the last reference to the Model
    object goes (a caller that keeps its freed models in a list, a registry, a closed server)."""
    m = tl.load_model(str(tiny_path), max_seq_len=SEQ, backend="cpu")
    held = tl.vram_usage_bytes(m)
    tl.free_model(m)
    assert held > 4 << 20
    kept = []

    def cycle():
        m = tl.load_model(str(tiny_path), max_seq_len=SEQ, backend="cpu")
        tl.generate(m, P, CFG)
        tl.free_model(m)
        kept.append(m)
    first, second = _growth_per_cycle(cycle)
    assert second < held / 8 and first < held / 8, (first, second, held)
    with pytest.raises(tl.ModelFreedError):
        tl.generate(kept[-1], P, CFG)
    assert kept[-1].cfg.vocab_size == 97 and kept[-1].path      # what describes the model stays


def test_server_apps_created_and_closed_give_their_model_memory_back(tiny_path):
    """create_app + Served.close() (the server loaded the model, so close frees it), the app then
    dropped: FastAPI keeps the route functions (and through them the Served) in a bounded cache, so
    whatever a freed model still held would stay with each closed app."""
    pytest.importorskip("fastapi")
    pytest.importorskip("prometheus_client")
    from tinyloop.serve import ServeConfig, create_app
    threads = threading.active_count()
    m = tl.load_model(str(tiny_path), max_seq_len=SEQ, backend="cpu")
    held = tl.vram_usage_bytes(m)
    tl.free_model(m)

    def cycle():
        app = create_app(ServeConfig(model=str(tiny_path), backend="cpu", max_seq_len=SEQ))
        app.state.served.close()
        assert app.state.served.model._freed
    first, second = _growth_per_cycle(cycle)
    assert second < held / 8 and first < held / 8, (first, second, held)
    assert threading.active_count() == threads            # every worker thread ended


def test_grammar_bookkeeping_does_not_grow_with_models_loaded_and_freed(tmp_path):
    """Each model whose tokenizer compiled a grammar, once freed and dropped, leaves nothing behind
    in tinyloop's process-wide grammar state (a server that reloads models runs for months)."""
    pytest.importorskip("llguidance")
    from tinyloop.runtime import grammar as gmod
    path = tmp_path / "bytes.tinyloop"
    write_tiny(path, vocab_size=300)            # >= 256: the raw-bytes tokenizer serves text
    g = tl.Grammar.regex("[a-z]{1,3}")

    def cycle():
        m = tl.load_model(str(path), max_seq_len=64, backend="cpu")
        tl.generate(m, P, tl.GenerateConfig(max_tokens=2, grammar=g))
        tl.free_model(m)

    def size() -> int:
        gc.collect()
        return sum(len(v) for v in vars(gmod).values()
                   if isinstance(v, (set, dict)) or type(v).__name__ == "WeakKeyDictionary")
    cycle()
    a = size()
    for _ in range(4):
        cycle()
    b = size()
    for _ in range(4):
        cycle()
    c = size()
    assert c - b <= 1 and b - a <= 1, (a, b, c)
    tl.generate(tl.load_model(str(path), max_seq_len=64, backend="cpu"), P,
                tl.GenerateConfig(max_tokens=2, grammar=g))      # the grammar still serves a new model
