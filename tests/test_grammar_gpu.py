"""Grammar-constrained decoding on the CUDA backend (marker gpu): greedy constrained tokens are the
CPU backend's, for a JSON schema, a regex and a Lark grammar."""

from __future__ import annotations

import pytest

import tinyloop as tl

from conftest import real_gpu

pytestmark = pytest.mark.gpu

if not real_gpu():
    pytest.skip("no CUDA GPU", allow_module_level=True)
pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


GRAMMARS = [
    {"json_schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                      "n": {"type": "integer"}},
                     "required": ["name", "n"], "additionalProperties": False}},
    {"regex": r"[a-z_]+\([a-z, ]*\):"},
    {"lark": 'start: NUM ("+" NUM)*\nNUM: /[0-9]{1,3}/'},
]


@pytest.mark.parametrize("g", GRAMMARS, ids=["json_schema", "regex", "lark"])
@pytest.mark.parametrize("loops", [2, 4])
def test_constrained_greedy_tokens_equal_cpu(pair, g, loops):
    cpu, gpu = pair
    for prompt in ("value = ", "def "):
        ids = cpu.tokenizer.encode(prompt)
        cfg = tl.GenerateConfig(max_tokens=48, loops=loops, grammar=g)
        assert tl.generate(gpu, ids, cfg) == tl.generate(cpu, ids, cfg)


def test_device_mask_keeps_greedy_on_the_device(pair, monkeypatch):
    """Under a grammar the greedy step stays on the device path: the mask goes up
    (launch_masked_argmax), the next step is queued before the token is read back, and the tokens equal the host-mask
    path's (token_masks switched off: logits copied to the host and masked there)."""
    cpu, gpu = pair
    monkeypatch.delenv("TINYLOOP_LOOKAHEAD", raising=False)
    be = gpu.backend
    calls = []
    begin, mask = be.begin_read_argmax, be.launch_masked_argmax
    monkeypatch.setattr(be, "begin_read_argmax", lambda ws: (calls.append("ahead"), begin(ws)))
    monkeypatch.setattr(be, "launch_masked_argmax", lambda ws, w: (calls.append("mask"), mask(ws, w)))
    for g in GRAMMARS:
        ids = cpu.tokenizer.encode("value = ")
        cfg = tl.GenerateConfig(max_tokens=32, loops=3, grammar=g)
        st_ = tl.GenerateStats()
        calls.clear()
        out = tl.generate(gpu, ids, cfg, stats=st_)
        n = st_.tokens_emitted
        assert calls.count("mask") == n and calls.count("ahead") >= n - 1
        supports = be.supports
        monkeypatch.setattr(be, "supports", lambda c: c != "token_masks" and supports(c))
        calls.clear()
        assert tl.generate(gpu, ids, cfg) == out and not calls
        monkeypatch.setattr(be, "supports", supports)
