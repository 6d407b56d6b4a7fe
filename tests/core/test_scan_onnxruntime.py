"""The ONNX Runtime scan agrees with the NumPy reference and refuses what it cannot honour."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.config import ConfigError, EngineConfig
from prepos.scan import get_scan, scan_numpy
from prepos.scan_onnxruntime import OnnxRuntimeScan, scan_onnxruntime


def _assert_features(ref, got, tol=1e-5):
    assert got.num_allowed == ref.num_allowed
    for name in ("p_max", "margin", "entropy"):
        assert math.isclose(getattr(ref, name), getattr(got, name), rel_tol=tol, abs_tol=tol), name


@st.composite
def scan_case(draw):
    vocab = draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        logits = rng.normal(0, draw(st.sampled_from([0.1, 1.0, 5.0])), vocab)
    else:  # few distinct values: ties everywhere, greedy must take the lowest id
        logits = rng.integers(-2, 3, vocab).astype(np.float64)
    logits = logits.astype(draw(st.sampled_from([np.float32, np.float16])))
    if vocab > 1 and draw(st.booleans()):  # -inf entries, as masked logits have
        logits[rng.choice(vocab, size=vocab // 3, replace=False)] = -np.inf
        logits[rng.integers(vocab)] = 1.0
    allowed = None
    if draw(st.booleans()):
        finite = np.flatnonzero(np.isfinite(logits))
        size = draw(st.integers(1, min(8, len(finite))))
        allowed = sorted(rng.choice(finite, size=size, replace=False).tolist())
    temperature = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0]))
    return logits, dict(allowed_ids=allowed, temperature=temperature, top_k=draw(st.sampled_from([0, 1, 3, 50])),
                        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])), uniform=draw(st.floats(0.0, 0.999)))


@settings(max_examples=60, deadline=None)
@given(scan_case())
def test_onnxruntime_scan_agrees_with_reference(case):
    logits, kw = case
    ref = scan_numpy(logits, **kw)
    got = scan_onnxruntime(logits, **kw)
    _assert_features(ref, got)
    if kw["temperature"] == 0.0:
        assert got.token_id == ref.token_id
    elif got.token_id != ref.token_id:
        # only where u or top_p sits on a float-rounding boundary of the cumulative mass (tied logits put
        # top_p exactly on one: 25 tokens of 1/50 each reach 0.5)
        near = {scan_numpy(logits, **{**kw, "uniform": min(0.999999, max(0.0, kw["uniform"] + du)),
                                      "top_p": kw["top_p"] + dp}).token_id
                for du in (-1e-5, 0.0, 1e-5) for dp in ((-1e-6, 0.0, 1e-6) if kw["top_p"] < 1.0 else (0.0,))}
        assert got.token_id in near


def test_greedy_ties_take_the_lowest_allowed_id():
    logits = np.array([0.0, 3.0, 1.0, 3.0, 3.0], dtype=np.float32)
    assert scan_onnxruntime(logits).token_id == 1
    assert scan_onnxruntime(logits, allowed_ids=[0, 3, 4]).token_id == 3
    one = scan_onnxruntime(logits, allowed_ids=[2])
    assert (one.token_id, one.p_max, one.margin, one.num_allowed) == (2, 1.0, 1.0, 1)


def test_sampling_cuts_as_the_reference():
    logits = np.log(np.array([0.2, 0.5, 0.3], dtype=np.float32))
    for kw, token in [({"uniform": 0.1}, 1), ({"uniform": 0.6}, 2), ({"uniform": 0.95}, 0),
                      ({"top_k": 2, "uniform": 0.95}, 2), ({"top_p": 0.5, "uniform": 0.95}, 1)]:
        assert scan_onnxruntime(logits, temperature=1.0, **kw).token_id == token, kw
    # a masked token is never sampled, whatever the draw
    assert {scan_onnxruntime(logits, allowed_ids=[0, 2], temperature=1.0, uniform=u).token_id
            for u in (0.0, 0.5, 0.999999999)} <= {0, 2}


def test_torch_inputs_bfloat16_and_large_vocab():
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.normal(0, 4, 151_936).astype(np.float32)).to(torch.bfloat16)
    ref = scan_numpy(logits.float().numpy())
    got = scan_onnxruntime(logits)
    assert got.token_id == ref.token_id
    _assert_features(ref, got, tol=1e-4)  # float32 sums over 152k terms
    assert scan_onnxruntime(logits, allowed_ids=torch.tensor([5, 7])).num_allowed == 2


@pytest.mark.parametrize("logits, kw, field", [
    (np.array([-np.inf, -np.inf], dtype=np.float32), {}, "no finite logit"),
    (np.array([np.nan, 1.0], dtype=np.float32), {}, "the logit of token 0 is NaN"),
    (np.array([np.inf, 1.0], dtype=np.float32), {}, r"the logit of token 0 is \+inf"),
    (np.array([0.0, -np.inf], dtype=np.float32), {"allowed_ids": [1]}, "no finite logit"),
    (np.zeros(3, dtype=np.float32), {"temperature": 1.0}, "uniform draw"),
    (np.zeros(3, dtype=np.float32), {"temperature": -1.0, "uniform": 0.5}, "temperature"),
    (np.zeros(3, dtype=np.float32), {"allowed_ids": []}, "allowed_ids"),
    (np.zeros(3, dtype=np.float32), {"allowed_ids": [3]}, "allowed_ids"),
    (np.zeros(3, dtype=np.float32), {"allowed_ids": [-1]}, "allowed_ids"),
    (np.zeros(3, dtype=np.float32), {"allowed_ids": [1, 1]}, "allowed_ids"),
    (np.zeros(3, dtype=np.float64), {}, "logits"),
    (np.zeros((2, 3), dtype=np.float32), {}, "logits"),
])
def test_bad_input_is_refused_naming_the_field(logits, kw, field):
    with pytest.raises(ValueError, match=field):
        scan_onnxruntime(logits, **kw)


def test_one_session_per_dtype_whatever_the_vocabulary():
    scan = OnnxRuntimeScan()
    for vocab in (3, 17, 1000):
        scan(np.zeros(vocab, dtype=np.float32))
    first = scan.session("float32")
    scan(np.zeros(5, dtype=np.float16))
    assert scan.session("float32") is first
    assert scan.session("float16") is not first
    with pytest.raises(ValueError, match="num_threads"):
        OnnxRuntimeScan(num_threads=0)


def test_selectable_by_name_in_registry_and_config():
    logits = np.array([0.0, 2.0, 1.0], dtype=np.float32)
    assert get_scan("onnxruntime")(logits, allowed_ids=[0, 2]).token_id == 2
    assert EngineConfig(scan="onnxruntime").scan == "onnxruntime"
    with pytest.raises(ConfigError, match="engine.scan"):
        EngineConfig(scan="onnx")
