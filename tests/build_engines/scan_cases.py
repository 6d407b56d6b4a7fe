"""Random scan cases and the check of a scan's outputs against the NumPy reference, shared by the tests of
the scan's ONNX form and of the TensorRT plugin's maths."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import strategies as st

from prepos.scan import scan_numpy

CASE = dict(vocab=st.integers(1, 200), seed=st.integers(0, 2**31 - 1), ties=st.booleans(), masked=st.booleans(),
            temperature=st.sampled_from([0.0, 0.0, 0.7, 1.5]), top_k=st.sampled_from([0, 2, 40]),
            top_p=st.sampled_from([1.0, 0.8]), u=st.floats(0.0, 0.999))


def make_logits(vocab: int, seed: int, ties: bool, masked: bool, dtype) -> tuple[np.ndarray, list[int] | None]:
    """Logits with -inf entries and (``ties``) repeated values, and (``masked``) a sorted allowed set."""
    rng = np.random.default_rng(seed)
    logits = (rng.integers(-2, 3, vocab) if ties else rng.normal(0, 3, vocab)).astype(dtype)
    logits[rng.random(vocab) < 0.2] = -np.inf
    logits[rng.integers(vocab)] = 2.0
    size = int(rng.integers(1, vocab + 1))
    allowed = sorted(rng.choice(vocab, size=size, replace=False).tolist()) if masked else None
    return logits, allowed


def check_against_reference(logits, kw: dict, outputs: tuple[int, float, float, float]) -> None:
    """``outputs`` (token, p_max, margin, entropy) of a scan called with ``kw`` agree with the reference; with
    no finite allowed logit, p_max is NaN and the reference raises."""
    token, p_max, margin, entropy = outputs
    allowed = kw["allowed_ids"]
    if not np.isfinite(logits if allowed is None else logits[allowed]).any():
        assert math.isnan(p_max)  # the caller turns this into the reference's error
        with pytest.raises(ValueError, match="no finite logit"):
            scan_numpy(logits, **kw)
        return
    ref = scan_numpy(logits, **kw)
    for got, want in ((p_max, ref.p_max), (margin, ref.margin), (entropy, ref.entropy)):
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
    if kw["temperature"] == 0.0:
        assert token == ref.token_id
    elif token != ref.token_id:  # a draw or top_p on a float-rounding boundary of the cumulative mass
        u, top_p = kw["uniform"], kw["top_p"]
        near = {scan_numpy(logits, **{**kw, "uniform": min(0.999999, max(0.0, u + du)), "top_p": top_p + dp}).token_id
                for du in (-1e-5, 0.0, 1e-5) for dp in ((-1e-6, 0.0, 1e-6) if top_p < 1.0 else (0.0,))}
        assert token in near
