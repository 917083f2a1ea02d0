"""Group-wise quantization and bit packing (tinyloop.model.quant)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinyloop.model import quant
from tinyloop.model.arch import TensorQuant
from tinyloop.errors import ConfigError
from tinyloop.model.quant import dequantize, dequantize_tensor, pack, quantize, quantize_tensor, unpack


@st.composite
def codes(draw):
    bits = draw(st.sampled_from([2, 4, 8]))
    per = 8 // bits
    shape = (draw(st.integers(0, 5)), per * draw(st.integers(0, 12)))
    q = draw(hnp.arrays(np.uint8, shape, elements=st.integers(0, (1 << bits) - 1)))
    return bits, q


@given(codes())
def test_pack_unpack_round_trip(case):
    bits, q = case
    packed = pack(q, bits)
    assert packed.dtype == np.uint8
    assert packed.shape == (q.shape[0], q.shape[1] * bits // 8)
    assert np.array_equal(unpack(packed, bits, q.shape[1]), q)


def test_pack_bit_order():
    assert pack(np.array([[1, 2]]), 4).tolist() == [[0x21]]
    assert pack(np.array([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack(np.array([[7, 255]]), 8).tolist() == [[7, 255]]
    assert unpack(np.array([[0xA5]], np.uint8), 4, 2).tolist() == [[5, 10]]
    assert unpack(np.array([[0b11100100]], np.uint8), 2, 4).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("q, bits, match", [
    (np.array([[16, 0]]), 4, r"\[0, 15\]"),
    (np.array([[4, 0, 0, 0]]), 2, r"\[0, 3\]"),
    (np.array([[-1, 0]]), 4, r"\[0, 15\]"),
    (np.array([[1, 2, 3]]), 4, "multiple of 2"),
    (np.array([[1, 2]]), 2, "multiple of 4"),
    (np.array([1, 2]), 4, "2-D"),
    (np.array([[1.0, 2.0]]), 4, "integer"),
    ([[1, 2]], 4, "integer"),
    (np.array([[1, 2]]), 3, "bits=3"),
    (np.array([[1, 2]]), True, "bits=True"),
])
def test_pack_rejects(q, bits, match):
    with pytest.raises(ConfigError, match=match):
        pack(q, bits)


@pytest.mark.parametrize("packed, bits, cols, match", [
    (np.zeros((2, 3), np.uint8), 4, 8, "expected cols=8"),
    (np.zeros((2, 3), np.uint8), 2, 7, "multiple of 4"),
    (np.zeros((2, 3), np.uint8), 4, -2, "non-negative"),
    (np.zeros((2, 3), np.int32), 4, 6, "uint8"),
    (np.zeros(3, np.uint8), 4, 6, "2-D"),
    (np.zeros((2, 3), np.uint8), 5, 6, "bits=5"),
])
def test_unpack_rejects(packed, bits, cols, match):
    with pytest.raises(ConfigError, match=match):
        unpack(packed, bits, cols)


def _check_bound(w, tq, parts):
    """Every element within scale / 2 of its dequantized value; the float32 result equals the
    float64 reference (q - zero) * scale exactly."""
    rows, cols = w.shape
    g = tq.group_size
    scales, zeros = parts["scales"], parts["zeros"]
    assert parts["q"].dtype == np.uint8 and parts["q"].shape == (rows, cols * tq.bits // 8)
    assert scales.dtype == np.float16 and scales.shape == (rows, cols // g)
    assert zeros.dtype == np.uint8 and zeros.shape == (rows, cols // g)
    assert np.isfinite(scales).all() and (scales > 0).all()
    assert (zeros < 1 << tq.bits).all()
    out = dequantize(parts, tq, w.shape)
    assert out.dtype == np.float32 and out.shape == w.shape
    q = unpack(parts["q"], tq.bits, cols).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), g, axis=1)
    ref = (q - np.repeat(zeros.astype(np.float64), g, axis=1)) * s
    assert np.array_equal(out.astype(np.float64), ref)
    assert (np.abs(ref - w.astype(np.float64)) <= s * (0.5 + 1e-9)).all()


@st.composite
def weights(draw):
    tq = TensorQuant(draw(st.sampled_from(["q2", "q4", "q8"])), draw(st.sampled_from([8, 16, 32])))
    shape = (draw(st.integers(1, 4)), tq.group_size * draw(st.integers(1, 3)))
    scale = draw(st.sampled_from([1e-6, 1e-2, 1.0, 1e3]))
    unit = st.floats(-1, 1, width=32, allow_subnormal=False)
    w = draw(hnp.arrays(np.float32, shape, elements=unit)) * np.float32(scale)
    return w, tq


@settings(max_examples=150, deadline=None)
@given(weights())
def test_quantize_error_bounded_by_half_scale(case):
    w, tq = case
    _check_bound(w, tq, quantize(w, tq))


@pytest.mark.parametrize("tq", [TensorQuant("q2", 8), TensorQuant("q4", 16), TensorQuant("q8", 8)])
@pytest.mark.parametrize("value", [0.0, 3.5, -2.25, 1e-30, -7e4])
def test_constant_groups(tq, value):
    w = np.full((3, 2 * tq.group_size), value)
    w[1, : tq.group_size] = 0.0  # a zero group next to a constant one
    parts = quantize(w, tq)
    _check_bound(w, tq, parts)
    assert not dequantize(parts, tq, w.shape)[1, : tq.group_size].any()


def test_all_zero_tensor_is_exact():
    tq = TensorQuant("q4", 8)
    parts = quantize(np.zeros((2, 16), np.float32), tq)
    assert (parts["scales"] == 1).all() and not parts["zeros"].any()
    assert not dequantize(parts, tq, (2, 16)).any()


def test_row_chunks_match_single_pass(monkeypatch):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 64)).astype(np.float32)
    tq = TensorQuant("q4", 16)
    whole = quantize(w, tq)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 100)  # 1 row (64 elements) per step
    chunked = quantize(w, tq)
    for key in whole:
        assert np.array_equal(whole[key], chunked[key])


def test_float_paths():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    f32 = quantize(w, TensorQuant("f32"))
    assert list(f32) == [""] and f32[""].dtype == np.float32 and np.array_equal(f32[""], w)
    assert dequantize(f32, TensorQuant("f32"), w.shape) is f32[""]  # no copy
    f16 = quantize(w.astype(np.float64), TensorQuant("f16"))
    assert f16[""].dtype == np.float16 and np.array_equal(f16[""], w.astype(np.float16))
    out = dequantize(f16, TensorQuant("f16"), w.shape)
    assert out.dtype == np.float32 and np.array_equal(out, w.astype(np.float16).astype(np.float32))
    norm = quantize(np.arange(5.0), TensorQuant("f16"))[""]
    assert norm.shape == (5,) and norm.dtype == np.float16


def test_tensor_wrappers_use_physical_names():
    w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    tq = TensorQuant("q4", 16)
    phys = quantize_tensor("loop.0.wq", w, tq)
    assert list(phys) == ["loop.0.wq.q", "loop.0.wq.scales", "loop.0.wq.zeros"]
    assert np.array_equal(dequantize_tensor("loop.0.wq", phys, tq, w.shape), dequantize(quantize(w, tq), tq, w.shape))
    assert list(quantize_tensor("final_norm", w[0], TensorQuant("f32"))) == ["final_norm"]
    del phys["loop.0.wq.zeros"]
    with pytest.raises(ConfigError, match=r"loop\.0\.wq: missing physical tensor.*zeros"):
        dequantize_tensor("loop.0.wq", phys, tq, w.shape)


@pytest.mark.parametrize("w, tq, match", [
    (np.array([[np.nan] + [0.0] * 7]), TensorQuant("q4", 8), r"value nan at index \(0, 0\) is not finite"),
    (np.array([[0.0] * 7 + [np.inf]]), TensorQuant("f32"), "inf at index"),
    (np.array([1.0, np.inf]), TensorQuant("f16"), "not finite"),
    (np.array([1.0, 1e6]), TensorQuant("f16"), r"1000000\.0 at index \(1,\) overflows f16"),
    (np.array([1e39]), TensorQuant("f32"), "overflows f32"),
    (np.zeros((2, 12)), TensorQuant("q4", 8), "not a multiple of group_size=8"),
    (np.zeros(16), TensorQuant("q4", 8), "only 2-D"),
    (np.full((1, 8), 1e9), TensorQuant("q2", 8), "float16 maximum"),
    (np.zeros((1, 8), bool), TensorQuant("q8", 8), "real numeric"),
    ([[0.0] * 8], TensorQuant("q8", 8), "real numeric"),
    (np.zeros((1, 8)), "q8", "TensorQuant"),
])
def test_quantize_rejects(w, tq, match):
    with pytest.raises(ConfigError, match=match):
        quantize(w, tq)


def test_dequantize_rejects_bad_parts():
    tq = TensorQuant("q4", 8)
    parts = quantize(np.ones((2, 16)), tq)
    with pytest.raises(ConfigError, match="missing part 'zeros'"):
        dequantize({k: v for k, v in parts.items() if k != "zeros"}, tq, (2, 16))
    with pytest.raises(ConfigError, match=r"part 'scales' must be f16 \(2, 2\)"):
        dequantize({**parts, "scales": parts["scales"].astype(np.float32)}, tq, (2, 16))
    with pytest.raises(ConfigError, match=r"part 'q' must be u8 \(2, 16\), got uint8 \(2, 8\)"):
        dequantize(parts, TensorQuant("q8", 8), (2, 16))
