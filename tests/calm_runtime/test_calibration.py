"""The one calibration formula (docs/methods.md §1): apply_calibration, fused_head, is_identity.

Every case is checked on numpy and on torch, and the fused head is checked against the
unfused formula: ``W' h + b' == apply_calibration(W h + b, tau, shift, T)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from calm_runtime.calibration import apply_calibration, fused_head, is_identity

# float32 parity of the fused head against the unfused formula: the fused form rounds
# 1/(tau*T) once and then sums d products, the unfused one sums first and divides after,
# so they differ by a few float32 ulps of the summed magnitude |W| |h| + |b|.
FLOAT32_RTOL = 1e-5
# float64 property test: the same reassociation, bounded by (d + a few) ulps of the
# magnitude of the terms; 64 ulps leaves room for d <= 16 plus the divisions and the add.
FLOAT64_ULPS = 64

V, D = 37, 8


def _case(seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        "weight": rng.normal(size=(V, D)).astype(dtype),
        "bias": rng.normal(size=V).astype(dtype),
        "hidden": rng.normal(size=(5, D)).astype(dtype),
        "tau": rng.uniform(0.2, 3.0, size=V).astype(dtype),
        "shift": rng.normal(size=V).astype(dtype),
    }


def _to_torch(case: dict) -> dict:
    return {k: torch.from_numpy(v) for k, v in case.items()}


def _head(weight, bias, hidden):
    """``z = h W^T + b`` for a batch of hidden states ``[N, d]`` (numpy or torch)."""
    z = hidden @ weight.T
    return z if bias is None else z + bias


# (tau, shift, T) variants: which of the calibration parts are present
VARIANTS = {
    "identity": (False, False, 1.0),
    "tau_only": (True, False, 1.0),
    "shift_only": (False, True, 1.0),
    "temperature_only": (False, False, 1.7),
    "tau_shift": (True, True, 1.0),
    "all": (True, True, 0.6),
    "tau_temperature": (True, False, 2.5),
    "shift_temperature": (False, True, 0.8),
}


def _parts(case: dict, variant: str):
    use_tau, use_shift, temperature = VARIANTS[variant]
    return (case["tau"] if use_tau else None, case["shift"] if use_shift else None,
            temperature)


def _assert_close(actual, expected, rtol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = np.maximum(np.abs(expected), 1.0)
    err = np.abs(actual - expected) / scale
    assert err.max() <= rtol, f"{what}: max scaled difference {err.max():.3g} > {rtol}"


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_head_equals_unfused_numpy_and_torch(variant, with_bias):
    case = _case()
    results = {}
    for backend, data in (("numpy", case), ("torch", _to_torch(case))):
        tau, shift, temperature = _parts(data, variant)
        bias = data["bias"] if with_bias else None
        new_w, new_b = fused_head(data["weight"], bias, tau, shift, temperature)
        assert type(new_w) is type(data["weight"])
        if not with_bias and shift is None:
            assert new_b is None, "no bias and no shift must give a head without bias"
        else:
            assert type(new_b) is type(data["weight"])
            assert tuple(new_b.shape) == (V,)
        assert tuple(new_w.shape) == (V, D)
        fused = _head(new_w, new_b, data["hidden"])
        unfused = apply_calibration(_head(data["weight"], bias, data["hidden"]), tau, shift,
                                    temperature)
        assert type(unfused) is type(data["weight"])
        _assert_close(fused, unfused, FLOAT32_RTOL, f"{backend} fused vs unfused ({variant})")
        # the same logits on both backends (matmuls may sum in different orders)
        z = _head(case["weight"], case["bias"] if with_bias else None, case["hidden"])
        same_z = z if backend == "numpy" else torch.from_numpy(z)
        results[backend] = (new_w, new_b, apply_calibration(same_z, tau, shift, temperature))
    # numpy and torch run the same elementwise IEEE operations: identical bits
    for np_value, torch_value in zip(results["numpy"], results["torch"], strict=True):
        if np_value is None:
            assert torch_value is None
            continue
        np.testing.assert_array_equal(np_value, torch_value.numpy())


def test_apply_calibration_matches_formula():
    case = _case(1)
    z = _head(case["weight"], case["bias"], case["hidden"])
    z64 = z.astype(np.float64)
    tau, shift = case["tau"].astype(np.float64), case["shift"].astype(np.float64)
    expected = (z64 / tau + shift) / 0.7
    got = apply_calibration(z, case["tau"], case["shift"], 0.7)
    assert got.dtype == np.float32 and got.shape == z.shape
    _assert_close(got, expected, FLOAT32_RTOL, "apply_calibration vs float64 formula")
    got_t = apply_calibration(torch.from_numpy(z), torch.from_numpy(case["tau"]),
                              torch.from_numpy(case["shift"]), 0.7)
    assert got_t.dtype == torch.float32
    np.testing.assert_array_equal(got, got_t.numpy())


def test_apply_calibration_broadcasts_over_leading_axes():
    case = _case(2)
    z = np.random.default_rng(3).normal(size=(2, 3, V)).astype(np.float32)
    got = apply_calibration(z, case["tau"], case["shift"], 1.3)
    for i in range(2):
        for j in range(3):
            row = apply_calibration(z[i, j], case["tau"], case["shift"], 1.3)
            np.testing.assert_array_equal(got[i, j], row)


def test_scalar_temperature_is_the_special_case_tau_equals_t():
    # METHODS §1: scalar temperature scaling is tau = T * 1, shift = 0
    z = np.random.default_rng(4).normal(size=(6, V))
    t = 2.3
    np.testing.assert_allclose(apply_calibration(z, tau=np.full(V, t)),
                               apply_calibration(z, temperature=t), rtol=1e-15)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_identity_returns_input_unchanged(backend):
    case = _case(5)
    data = case if backend == "numpy" else _to_torch(case)
    z = _head(data["weight"], data["bias"], data["hidden"])
    assert apply_calibration(z) is z
    assert apply_calibration(z, None, None, 1.0) is z
    new_w, new_b = fused_head(data["weight"])
    assert new_w is data["weight"] and new_b is None
    new_w, new_b = fused_head(data["weight"], data["bias"])
    assert new_w is data["weight"]
    np.testing.assert_array_equal(np.asarray(new_b), np.asarray(data["bias"]))
    # explicit identity vectors change no value either
    ones = data["tau"] * 0 + 1
    zeros = data["shift"] * 0
    np.testing.assert_array_equal(np.asarray(apply_calibration(z, ones, zeros, 1.0)),
                                  np.asarray(z))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_is_identity(backend):
    make = (lambda a: a) if backend == "numpy" else torch.from_numpy
    ones = make(np.ones(V, np.float32))
    zeros = make(np.zeros(V, np.float32))
    assert is_identity()
    assert is_identity(None, None, 1.0)
    assert is_identity(ones, zeros, 1.0)
    assert is_identity(ones, None)
    assert is_identity(None, zeros)
    assert not is_identity(temperature=1.5)
    assert not is_identity(ones, zeros, 0.5)
    tau = make(np.ones(V, np.float32))
    tau[V - 1] = 1.01
    assert not is_identity(tau, zeros)
    shift = make(np.zeros(V, np.float32))
    shift[0] = -1e-3
    assert not is_identity(ones, shift)
    assert not is_identity(None, shift)


# ---------------------------------------------------------------------- property test
_finite = st.floats(-8.0, 8.0, allow_nan=False, allow_infinity=False, width=64)
_positive = st.floats(0.05, 20.0, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def _heads(draw):
    vocab = draw(st.integers(1, 24))
    dim = draw(st.integers(1, 16))
    n = draw(st.integers(1, 4))
    return {
        "weight": draw(arrays(np.float64, (vocab, dim), elements=_finite)),
        "bias": draw(st.none() | arrays(np.float64, (vocab,), elements=_finite)),
        "hidden": draw(arrays(np.float64, (n, dim), elements=_finite)),
        "tau": draw(st.none() | arrays(np.float64, (vocab,), elements=_positive)),
        "shift": draw(st.none() | arrays(np.float64, (vocab,), elements=_finite)),
        "temperature": draw(st.just(1.0) | _positive),
    }


@settings(max_examples=150, deadline=None)
@given(_heads())
def test_fused_head_property(head):
    weight, bias, hidden = head["weight"], head["bias"], head["hidden"]
    tau, shift, temperature = head["tau"], head["shift"], head["temperature"]
    unfused = apply_calibration(_head(weight, bias, hidden), tau, shift, temperature)
    new_w, new_b = fused_head(weight, bias, tau, shift, temperature)
    fused = _head(new_w, new_b, hidden)
    # magnitude of the terms each output sums, after the division by tau * T
    tau_t = (np.ones(weight.shape[0]) if tau is None else tau) * temperature
    magnitude = (np.abs(hidden) @ np.abs(weight).T
                 + (0.0 if bias is None else np.abs(bias))) / tau_t
    magnitude = magnitude + (0.0 if shift is None else np.abs(shift) / temperature)
    bound = FLOAT64_ULPS * np.finfo(np.float64).eps * np.maximum(magnitude, 1e-300)
    err = np.abs(fused - unfused)
    assert np.all(err <= bound), f"max |fused - unfused| {err.max():.3g} exceeds the bound"

    torch_w, torch_b = fused_head(
        torch.from_numpy(weight), None if bias is None else torch.from_numpy(bias),
        None if tau is None else torch.from_numpy(tau),
        None if shift is None else torch.from_numpy(shift), temperature)
    np.testing.assert_array_equal(new_w, torch_w.numpy())
    if new_b is None:
        assert torch_b is None
    else:
        np.testing.assert_array_equal(new_b, torch_b.numpy())
