"""Mixed precision's pieces: 16-bit rounding, the loss scaler, the derived tolerance."""

import math

import ml_dtypes
import numpy as np
import pytest

from summasim import validate
from summasim.transformer.precision import (LossScaler, Precision, has_overflow,
                                            round_bfloat16_bits)

EDGES = np.array([0.0, -0.0, 1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -9, 1.0 + 2.0 ** -9,
                  3.0e38, 3.4e38, -3.4e38, 1e-40, 6.0e4, 65519.0, 65520.0, np.inf, -np.inf,
                  np.nan, 1.00390625, 1.01171875], dtype=np.float32)


def _values(seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-30, 30, 4000)).astype(np.float32)
    return np.concatenate([x, EDGES])


def test_bfloat16_rounding_is_ml_dtypes_round_to_nearest_even():
    x = _values()
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = Precision.of("bfloat16").round(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)        # NaN == NaN for assert_array_equal
    # the bit-pattern rounding (the path for array modules without bfloat16) agrees
    np.testing.assert_array_equal(round_bfloat16_bits(x, np), want)
    # ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7
    assert Precision.of("bfloat16").round(np.float32([1.0 + 2.0 ** -8]))[0] == 1.0
    # every NaN stays a NaN, whatever its payload (rounding it would carry into Inf or 0)
    nans = np.array([0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FC00000, 0xFF80FFFF],
                    np.uint32).view(np.float32)
    assert np.isnan(round_bfloat16_bits(nans, np)).all()


def test_float16_rounding_and_overflow():
    x = _values(1)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = Precision.of("float16").round(x)
    np.testing.assert_array_equal(got, want)
    assert math.isinf(Precision.of("float16").round(np.float32([70000.0]))[0])


def test_rounding_error_is_at_most_the_unit_roundoff():
    x = np.random.default_rng(2).standard_normal(10000).astype(np.float32)
    for name in ("bfloat16", "float16"):
        p = Precision.of(name)
        rel = np.abs(p.round(x).astype(np.float64) - x) / np.abs(x)
        assert rel.max() <= p.unit_roundoff
        assert rel.max() > p.unit_roundoff / 2     # and the bound is the right one
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Precision.of("float32")


def test_dynamic_scaler_halves_and_skips_on_overflow_and_grows_after_an_interval():
    s = LossScaler("dynamic", init=1024.0, growth_interval=3)
    assert s.update(False) and s.scale == 1024.0
    assert not s.update(True) and s.scale == 512.0 and s.skipped == 1
    assert s.update(False) and s.update(False) and s.scale == 512.0
    assert s.update(False) and s.scale == 1024.0      # three good steps in a row
    for _ in range(40):
        s.update(True)
    assert s.scale == 1.0 and s.skipped == 41         # never below min_scale


def test_static_and_no_scaling_keep_the_scale_but_still_skip():
    s = LossScaler("static:128")
    assert s.scale == 128.0 and not s.update(True) and s.scale == 128.0
    n = LossScaler("none")
    assert n.scale == 1.0 and not n.update(True) and n.skipped == 1
    for bad in ("static:0", "static:inf", "auto"):
        with pytest.raises(ValueError):
            LossScaler(bad)


def test_overflow_is_any_nonfinite_entry():
    a = np.ones(5)
    assert not has_overflow([a, np.zeros(0)])
    b = a.copy()
    b[3] = np.inf
    assert has_overflow([a, b])
    b[3] = np.nan
    assert has_overflow([b])


def test_mixed_tolerance_is_derived_from_the_16_bit_unit_roundoff():
    from summasim.spec import MODELS
    from summasim.transformer.model import Config

    c = Config.of(MODELS["tiny"])
    k, d = 8 * c.seq, 2 * (validate.GEMMS_PER_BLOCK * c.layers + 1)
    k = max(k, c.ffn_width, c.vocab)
    for name, u16 in (("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)):
        acc = 8 * math.sqrt(k) * (2.0 ** -24 + 2.0 ** -53)
        assert validate.training_tolerance(c, 8, name) == pytest.approx(
            math.sqrt(d) * (acc + 17 * u16), rel=1e-12)
    assert validate.training_tolerance(c, 8, "float16") < \
        validate.training_tolerance(c, 8, "bfloat16") < 1.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_gradient_reduction_adds_its_sum_of_partials_to_the_bound(dtype):
    """--grad-reduce bfloat16|float16 sums the n = m dp partial gradients in 16 bits:
    the bound adds (lambda sqrt(n) + 1) u_r of the reduction's type (bfloat16's under
    float16 compute); a float32 reduction adds nothing."""
    from summasim.spec import MODELS
    from summasim.transformer.model import Config

    c = Config.of(MODELS["tiny"])
    base = validate.mixed_tolerance(c, 8, dtype)
    assert validate.mixed_tolerance(c, 8, dtype, "float32", 64) == base
    for reduce, u_r in (("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)):
        for n in (1, 4, 64):
            assert validate.training_tolerance(c, 8, dtype, reduce, n) == pytest.approx(
                base + (8 * math.sqrt(n) + 1) * u_r, rel=1e-12)
    with pytest.raises(ValueError, match="partials"):
        validate.mixed_tolerance(c, 8, dtype, "bfloat16", 0)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_16_bit_messages_pack_exactly_and_add_in_16_bits(name):
    """A message's bits: packing rounds to the 16-bit type (exact on values that are
    16-bit already), unpacking is exact, and the ring's add is the 16-bit sum (rounded
    once to nearest), not the float32 sum."""
    from summasim.transformer.precision import bits_adder, pack_bits, unpack_bits

    prec = Precision.of(name)
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    bits = pack_bits(prec, x)
    assert bits.dtype == np.uint16 and bits.nbytes == 2 * x.size
    assert np.array_equal(unpack_bits(prec, bits), prec.round(x))
    assert np.array_equal(pack_bits(prec, prec.round(x)), bits)          # exact
    y = prec.round(np.random.default_rng(2).standard_normal(4096).astype(np.float32))
    out = np.empty_like(bits)
    bits_adder(prec)(bits, pack_bits(prec, y), out=out)
    exact = prec.round(x).astype(np.float64) + y
    assert np.array_equal(unpack_bits(prec, out), prec.round(exact.astype(np.float32)))
    assert not np.array_equal(unpack_bits(prec, out), prec.round(x) + y)  # it rounds
