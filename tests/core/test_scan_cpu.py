"""The scan on the compiled CPU kernel agrees with the NumPy reference (greedy) and with torch's scan (sampled:
the same token), and everything it does not take goes to torch's scan."""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.engines import cpu_kernels
from prepos.scan import scan_numpy, scan_torch
from prepos.scan_cpu import CpuKernelScan

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler on PATH: the kernel cannot be built here")


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    kernels = cpu_kernels.load(tmp_path_factory.mktemp("cache"))
    assert kernels is not None, "the kernels did not build or failed their self-test (see the log)"
    return CpuKernelScan(kernels)


def _same(got, ref, tol):
    assert got.token_id == ref.token_id
    assert got.num_allowed == ref.num_allowed
    for name in ("p_max", "margin", "entropy"):
        assert math.isclose(getattr(got, name), getattr(ref, name), rel_tol=tol, abs_tol=tol), name


@st.composite
def logits_case(draw):
    vocab = draw(st.sampled_from([1, 2, 3, 17, 400, 5_000, 49_152]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):  # ties: few distinct values, so maxima and runners-up repeat
        logits = rng.integers(-2, 3, vocab).astype(np.float32)
    else:
        logits = rng.normal(0, draw(st.sampled_from([0.01, 1.0, 8.0, 40.0])), vocab).astype(np.float32)
    if draw(st.booleans()):  # -inf entries (a masked vocabulary), at least one finite logit left
        logits[rng.random(vocab) < draw(st.sampled_from([0.3, 0.99]))] = -np.inf
        logits[rng.integers(vocab)] = 1.0
    return logits


@settings(max_examples=200, deadline=None)
@given(logits_case())
def test_greedy_scan_agrees_with_reference(scan, logits):
    _same(scan(torch.from_numpy(logits)), scan_numpy(logits), 1e-4)


def test_the_kernel_serves_the_greedy_whole_vocabulary_case(scan, monkeypatch):
    calls = []
    monkeypatch.setattr("prepos.scan_cpu.scan_torch", lambda *a, **kw: calls.append(kw) or scan_torch(*a, **kw))
    logits = torch.randn(49_152) * 3
    _same(scan(logits), scan_numpy(logits), 1e-4)
    assert not calls
    ties = torch.full((100,), -1.0)
    ties[[70, 20, 95]] = 3.0
    got = scan(ties)
    assert got.token_id == 20 and got.margin == 0.0 and not calls


@settings(max_examples=200, deadline=None)
@given(logits_case(), st.sampled_from([0.3, 0.8, 1.0, 2.0]), st.sampled_from([0, 1, 40, 1000]),
       st.sampled_from([1.0, 0.95, 0.5]), st.floats(0.0, 0.999999))
def test_sampled_scan_draws_torchs_token_with_the_kernels_features(scan, logits, temperature, top_k, top_p, uniform):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)
    got, want = scan(torch.from_numpy(logits), **kw), scan_torch(torch.from_numpy(logits), **kw)
    _same(got, want, 1e-4)
    greedy = scan(torch.from_numpy(logits))
    assert (got.p_max, got.margin, got.entropy) == (greedy.p_max, greedy.margin, greedy.entropy)  # the kernel's


def test_a_sampled_scan_without_a_draw_gets_torchs_error(scan):
    with pytest.raises(ValueError, match="uniform"):
        scan(torch.randn(100), temperature=0.7)


@pytest.mark.parametrize("kw", [
    dict(allowed_ids=[5, 9, 200, 17]),  # a small choices set
    dict(allowed_ids=list(range(0, 300, 3))),  # a large one
])
def test_what_the_kernel_does_not_take_is_torchs_scan(scan, kw):
    logits = torch.from_numpy(np.random.default_rng(3).normal(0, 2, 300).astype(np.float32))
    assert scan(logits, **kw) == scan_torch(logits, **kw)


def test_other_dtypes_and_layouts_are_torchs_scan(scan):
    base = torch.from_numpy(np.random.default_rng(5).normal(0, 2, 600).astype(np.float32))
    for logits in (base.half(), base.double(), base[::2]):
        assert scan(logits) == scan_torch(logits)


def test_bad_logits_get_the_general_scans_error(scan):
    for bad, problem in ((torch.full((50,), float("-inf")), "no finite logit"),
                         (torch.tensor([0.0, float("nan"), 1.0]), "the logit of token 1 is NaN"),
                         (torch.tensor([0.0, float("inf"), 1.0]), r"the logit of token 1 is \+inf")):
        with pytest.raises(ValueError, match=problem):
            scan(bad)
    logits = torch.randn(50)
    _same(scan(logits), scan_numpy(logits), 1e-5)  # still usable
