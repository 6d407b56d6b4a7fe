"""Scan implementations agree with the NumPy reference; the reference obeys its contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.scan import SCANS, get_scan, scan_numpy, scan_torch


def _assert_same(a, b, tol=1e-5):
    assert a.token_id == b.token_id
    assert a.num_allowed == b.num_allowed
    for name in ("p_max", "margin", "entropy"):
        assert math.isclose(getattr(a, name), getattr(b, name), rel_tol=tol, abs_tol=tol), name


@st.composite
def scan_case(draw):
    vocab = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, draw(st.sampled_from([0.1, 1.0, 5.0])), vocab).astype(np.float32)
    if draw(st.booleans()):  # -inf entries, as masked logits have
        logits[rng.choice(vocab, size=vocab // 3, replace=False)] = -np.inf
        logits[rng.integers(vocab)] = 1.0
    allowed = None
    if draw(st.booleans()):
        finite = np.flatnonzero(np.isfinite(logits))
        size = draw(st.integers(1, min(8, len(finite))))
        allowed = sorted(rng.choice(finite, size=size, replace=False).tolist())
    temperature = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]))
    top_k = draw(st.sampled_from([0, 1, 3, 50]))
    top_p = draw(st.sampled_from([1.0, 0.9, 0.5]))
    uniform = draw(st.floats(0.0, 0.999))
    return logits, dict(allowed_ids=allowed, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)


@settings(max_examples=300, deadline=None)
@given(scan_case())
def test_torch_scan_agrees_with_reference(case):
    logits, kw = case
    ref = scan_numpy(logits, **kw)
    got = scan_torch(torch.from_numpy(logits), **kw)
    if kw["temperature"] == 0.0:
        _assert_same(ref, got)
    else:  # a sampled token may differ only where u sits on a float-rounding boundary of the CDF
        for name in ("p_max", "margin", "entropy"):
            assert math.isclose(getattr(ref, name), getattr(got, name), rel_tol=1e-5, abs_tol=1e-5)
        if ref.token_id != got.token_id:
            near = [scan_numpy(logits, **{**kw, "uniform": min(0.999999, max(0.0, kw["uniform"] + d))}).token_id
                    for d in (-1e-5, 1e-5)]
            assert got.token_id in near


def test_reference_features_by_hand():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float64)).astype(np.float32)
    r = scan_numpy(logits)
    assert r.token_id == 0 and math.isclose(r.p_max, 0.5, rel_tol=1e-6) and math.isclose(r.margin, 0.2, rel_tol=1e-5)
    assert math.isclose(r.entropy, -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)), rel_tol=1e-5)
    sub = scan_numpy(logits, allowed_ids=[1, 2])  # renormalised over the allowed set
    assert sub.token_id == 1 and math.isclose(sub.p_max, 0.6, rel_tol=1e-5)
    one = scan_numpy(logits, allowed_ids=[2])
    assert one.token_id == 2 and one.p_max == 1.0 and one.margin == 1.0 and one.certainty == 1.0


def test_greedy_ties_pick_the_lowest_id():
    logits = np.array([0.0, 3.0, 3.0, 1.0], dtype=np.float32)
    for name in SCANS:
        assert get_scan(name)(torch.from_numpy(logits) if name == "torch" else logits).token_id == 1


def test_sampling_inverts_the_cdf_in_probability_order():
    logits = np.log(np.array([0.2, 0.5, 0.3])).astype(np.float32)
    # order by probability: id1 (0.5), id2 (0.3), id0 (0.2)
    assert scan_numpy(logits, temperature=1.0, uniform=0.1).token_id == 1
    assert scan_numpy(logits, temperature=1.0, uniform=0.6).token_id == 2
    assert scan_numpy(logits, temperature=1.0, uniform=0.95).token_id == 0
    assert scan_numpy(logits, temperature=1.0, top_k=2, uniform=0.95).token_id == 2
    assert scan_numpy(logits, temperature=1.0, top_p=0.5, uniform=0.95).token_id == 1


def test_errors_are_clear():
    with pytest.raises(ValueError, match="no finite logit"):
        scan_numpy(np.array([-np.inf, -np.inf], dtype=np.float32))
    with pytest.raises(ValueError, match="uniform"):
        scan_numpy(np.zeros(3, dtype=np.float32), temperature=1.0)
    with pytest.raises(ValueError, match="unknown scan"):
        get_scan("cuda-magic")


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.sampled_from([-np.inf, -3.0, 0.0, 0.5, 2.0, 7.25]), min_size=1, max_size=70),
    seed=st.integers(0, 2**16),
)
def test_small_choice_sets_take_the_host_path_and_agree_with_reference(values, seed):
    """Greedy scans over up to 64 allowed tokens (ties and -inf included) skip the tensor path."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=300).astype(np.float32)
    ids = rng.choice(300, size=len(values), replace=False)
    if not rng.integers(2):
        ids = np.sort(ids)
    logits[ids] = values
    if not np.isfinite(logits[ids]).any():
        with pytest.raises(ValueError):
            scan_torch(torch.from_numpy(logits), allowed_ids=ids.tolist())
        return
    want = scan_numpy(logits, allowed_ids=ids.tolist())
    got = scan_torch(torch.from_numpy(logits), allowed_ids=ids.tolist())
    assert got.token_id == want.token_id and got.num_allowed == want.num_allowed
    assert got.p_max == pytest.approx(want.p_max, abs=1e-9)
    assert got.margin == pytest.approx(want.margin, abs=1e-9)
    assert got.entropy == pytest.approx(want.entropy, abs=1e-9)
