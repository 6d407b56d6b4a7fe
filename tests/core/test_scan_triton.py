"""The scan kernel (OpenAI Triton) agrees with the NumPy reference.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before Triton is imported), with small blocks so that a
few hundred logits already span many parts and exercise the merge. With a CUDA
device the compiled kernel is checked at real vocabulary sizes and dtypes.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.scan import scan_numpy, scan_torch

triton = pytest.importorskip("triton", reason="OpenAI Triton is not installed")
from prepos.scan_triton import TritonScan, TritonUnavailable, triton_interprets  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _same(got, ref, tol=1e-5):
    assert got.token_id == ref.token_id
    assert got.num_allowed == ref.num_allowed
    for name in ("p_max", "margin", "entropy"):
        assert math.isclose(getattr(got, name), getattr(ref, name), rel_tol=tol, abs_tol=tol), name


@st.composite
def greedy_case(draw):
    vocab = draw(st.integers(1, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):  # ties: few distinct values, so maxima and runners-up repeat across parts
        logits = rng.integers(-2, 3, vocab).astype(np.float32)
    else:
        logits = rng.normal(0, draw(st.sampled_from([0.1, 1.0, 8.0])), vocab).astype(np.float32)
    if draw(st.booleans()):  # -inf entries, whole parts of them too
        logits[rng.random(vocab) < draw(st.sampled_from([0.3, 0.9]))] = -np.inf
        logits[rng.integers(vocab)] = 1.0
    allowed = None
    if draw(st.booleans()):
        size = draw(st.integers(1, vocab))
        allowed = rng.choice(vocab, size=size, replace=False).tolist()  # in any order, like a trie node's
        if not np.isfinite(logits[allowed]).any():
            logits[allowed[-1]] = 0.5
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    block = draw(st.sampled_from([16, 32, 128]))
    return logits.astype(dtype), allowed, block


@settings(max_examples=150, deadline=None)
@given(greedy_case())
def test_greedy_scan_agrees_with_reference(case):
    logits, allowed, block = case
    scan = TritonScan(DEVICE, block=block)
    got = scan(torch.from_numpy(logits).to(DEVICE), allowed_ids=allowed)
    tol = 1e-5 if logits.dtype == np.float32 else 1e-4  # fp16 inputs are exact in fp32; sums of many are not
    _same(got, scan_numpy(logits.astype(np.float32), allowed_ids=allowed), tol)


def test_ties_pick_the_first_maximum_across_parts():
    logits = np.full(100, -1.0, dtype=np.float32)
    logits[[70, 20, 95]] = 3.0  # maxima in three different 16-logit parts
    scan = TritonScan(DEVICE, block=16)
    got = scan(torch.from_numpy(logits).to(DEVICE))
    assert got.token_id == 20 and got.margin == 0.0
    # with choices too, the lowest id wins, whatever the order they are listed in, as in the reference
    got = scan(torch.from_numpy(logits).to(DEVICE), allowed_ids=[95, 1, 70, 20])
    assert got.token_id == 20 == scan_numpy(logits, allowed_ids=[95, 1, 70, 20]).token_id


@pytest.mark.parametrize("bad, problem", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_a_nan_or_infinite_logit_is_refused_naming_its_token_and_spoils_only_its_row(bad, problem):
    """The kernel passed over a NaN as if it were masked and answered with full certainty."""
    scan = TritonScan(DEVICE, block=16)
    logits = torch.from_numpy(np.random.default_rng(4).normal(0, 2, 100).astype(np.float32)).to(DEVICE)
    logits[77] = bad  # in a later part than the maximum's, most likely
    for kw in (dict(), dict(allowed_ids=[40, 77, 3])):
        with pytest.raises(ValueError, match=rf"^scan: the logit of token 77 is {problem}: "):
            scan(logits, **kw)
    assert scan(logits, allowed_ids=[3, 40]).token_id == scan_numpy(logits.cpu().numpy(), allowed_ids=[3, 40]).token_id
    batch = torch.stack([logits, logits.nan_to_num(posinf=0.0, nan=0.0)])
    feats = scan.features(batch).cpu()
    assert not math.isfinite(feats[0, 1]) or not math.isfinite(feats[0, 4])  # the host refuses this row
    assert math.isfinite(feats[1, 1]) and math.isfinite(feats[1, 4])
    assert int(feats[1, 0]) == scan_numpy(batch[1].cpu().numpy()).token_id


def test_rows_of_a_batch_are_scanned_independently_in_one_launch():
    rng = np.random.default_rng(1)
    batch = rng.normal(0, 3, (5, 300)).astype(np.float32)
    batch[2, :] = -np.inf
    batch[2, 7] = 0.0  # one finite logit: p_max 1, entropy 0
    scan = TritonScan(DEVICE, block=32)
    feats = scan.features(torch.from_numpy(batch).to(DEVICE)).cpu().numpy()
    for row, f in zip(batch, feats):
        ref = scan_numpy(row)
        assert int(f[0]) == ref.token_id
        assert math.isclose(f[1], ref.p_max, rel_tol=1e-5)
        assert math.isclose(f[1] - f[2], ref.margin, rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(f[3], ref.entropy, rel_tol=1e-5, abs_tol=1e-6)


def test_the_workspace_is_ready_again_after_each_launch():
    """The last part resets its row's ticket: a second, different scan on the same workspace is right too."""
    scan = TritonScan(DEVICE, block=16)
    rng = np.random.default_rng(2)
    for vocab in (200, 37, 200, 1):
        logits = rng.normal(0, 2, vocab).astype(np.float32)
        _same(scan(torch.from_numpy(logits).to(DEVICE)), scan_numpy(logits))


def test_sampling_takes_torchs_scan_on_the_same_device():
    logits = torch.from_numpy(np.random.default_rng(3).normal(0, 2, 300).astype(np.float32)).to(DEVICE)
    kw = dict(allowed_ids=[5, 9, 200, 17], temperature=0.8, top_k=3, top_p=0.9, uniform=0.61)
    assert TritonScan(DEVICE)(logits, **kw) == scan_torch(logits, **kw)


def test_errors_name_the_problem_and_leave_the_scan_usable():
    scan = TritonScan(DEVICE, block=16)
    masked = torch.full((50,), float("-inf"), device=DEVICE)
    with pytest.raises(ValueError, match="no finite logit"):
        scan(masked)
    with pytest.raises(ValueError, match="no finite logit"):
        scan(torch.zeros(50, device=DEVICE).masked_fill(torch.arange(50, device=DEVICE) < 40, float("-inf")),
             allowed_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="allowed ids must lie in"):
        scan(torch.zeros(50, device=DEVICE), allowed_ids=[3, 50])
    with pytest.raises(ValueError, match="empty allowed set"):
        scan(torch.zeros(50, device=DEVICE), allowed_ids=[])
    with pytest.raises(ValueError, match=r"logits must be \[vocab\]"):
        scan(torch.zeros(2, 50, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        TritonScan(DEVICE, block=100)
    logits = np.random.default_rng(4).normal(0, 2, 50).astype(np.float32)
    _same(scan(torch.from_numpy(logits).to(DEVICE)), scan_numpy(logits))


def test_a_device_the_kernel_cannot_run_on_in_this_process_is_refused_with_the_reason():
    other = "cuda" if not CUDA else "cpu"
    with pytest.raises(TritonUnavailable, match="CUDA|interpret"):
        TritonScan(other)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32_000, 128_256, 151_936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("choices", [False, True])
def test_gpu_kernel_agrees_with_reference_at_real_sizes(vocab, dtype, choices):
    gen = torch.Generator(device="cuda").manual_seed(vocab)
    scan = TritonScan("cuda")
    for spread in (1.0, 6.0):
        logits = (torch.randn(vocab, generator=gen, device="cuda") * spread).to(dtype)
        logits[torch.rand(vocab, generator=gen, device="cuda") < 0.1] = float("-inf")
        allowed = None
        if choices:
            allowed = torch.randperm(vocab, generator=gen, device="cuda")[:37].tolist()
            logits[allowed[5]] = 10.0
        ref = scan_numpy(logits.float().cpu().numpy(), allowed_ids=allowed)
        _same(scan(logits, allowed_ids=allowed), ref, 1e-5 if dtype == torch.float32 else 1e-4)


@pytest.mark.parametrize("value, interprets", [("1", True), ("0", False), (None, False), ("true", False)])
def test_interpretation_is_read_from_the_environment_where_triton_has_no_knobs(monkeypatch, value, interprets):
    # OpenAI Triton before 3.4 (NVIDIA's containers ship 3.0-3.2) has no triton.knobs: TRITON_INTERPRET decides.
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interprets(types.SimpleNamespace(__version__="3.2.0")) is interprets
    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(interpret=not interprets))
    assert triton_interprets(types.SimpleNamespace(knobs=knobs)) is (not interprets)  # knobs win where present
    if hasattr(triton, "knobs"):  # the installed Triton: its own knobs, or (before 3.4) the environment
        assert triton_interprets(triton) is bool(triton.knobs.runtime.interpret)
    else:
        assert triton_interprets(triton) is interprets


def test_the_scan_runs_interpreted_where_triton_has_no_knobs(monkeypatch):
    # The call sites, not only the helper: on OpenAI Triton 3.0-3.2 TritonScan read triton.knobs and raised.
    if CUDA:
        pytest.skip("runs the interpreted kernel on CPU tensors")
    monkeypatch.delattr(triton, "knobs", raising=False)  # absent already before 3.4
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.0])
    _same(TritonScan("cpu", block=16)(logits), scan_numpy(logits.numpy()))
