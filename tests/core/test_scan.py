"""Scan implementations agree with the NumPy reference; the reference obeys its contract."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prepos.scan import SAMPLING_HEADS, SCANS, get_scan, sample_index, scan_numpy, scan_torch


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
        allowed = rng.choice(finite, size=size, replace=False).tolist()
        if draw(st.booleans()):  # listed in any order: the answer must not depend on it
            allowed = sorted(allowed)
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


@st.composite
def sampling_case(draw):
    """Probabilities over up to 3,000 tokens: peaked or flat, with runs of exactly equal values (coarse logits)
    and zeros (-inf logits), a top-k/top-p cut and a draw."""
    vocab = draw(st.integers(2, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    logits = rng.normal(0, draw(st.sampled_from([0.3, 2.0, 8.0])), vocab)
    if draw(st.booleans()):
        logits = np.round(logits * draw(st.sampled_from([1.0, 4.0])))  # many exact ties
    if draw(st.booleans()):
        logits[rng.choice(vocab, size=vocab // 2, replace=False)] = -np.inf
        logits[rng.integers(vocab)] = 0.0
    q = torch.softmax(torch.tensor(logits, dtype=torch.float32) / draw(st.sampled_from([0.5, 1.0, 2.0])), 0)
    top_k = draw(st.sampled_from([0, 1, 3, 50, 700]))
    top_p = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5]))
    uniform = draw(st.sampled_from([0.0, 0.5, 0.999999]) | st.floats(0.0, 0.999999))
    heads = draw(st.sampled_from([(1,), (4, 32), (16,), (64, 512)]))
    return q, top_k, top_p, uniform, heads


@settings(max_examples=400, deadline=None)
@given(sampling_case())
def test_sampling_from_the_head_picks_what_sorting_everything_picks(case):
    """The draw found among the most likely tokens (topk, ties in id order) is the one the full sort finds: the
    same token, to the bit, wherever the cut and the draw fall, ties across the head's end included. (The full
    sort's agreement with the reference is test_torch_scan_agrees_with_reference's.)"""
    q, top_k, top_p, uniform, heads = case
    want = sample_index(q, top_k, top_p, uniform, heads=())  # the whole vocabulary sorted
    assert int(sample_index(q, top_k, top_p, uniform, heads=heads)) == int(want)


def test_ties_across_the_heads_end_keep_the_lowest_ids_first():
    # 10 tokens of equal top probability, the head holds 4 of them: the draw must walk them in id order
    q = torch.zeros(1000)
    tied = torch.tensor([900, 7, 512, 3, 999, 40, 41, 600, 8, 100])
    q[tied] = 0.1
    for i, uniform in enumerate(np.arange(10) / 10 + 0.05):
        got = int(sample_index(q, 0, 1.0, float(uniform), heads=(4,)))
        assert got == sorted(tied.tolist())[i]


def test_a_peaked_distribution_is_sampled_without_sorting_the_vocabulary(monkeypatch):
    logits = torch.randn(49152) * 4
    sizes = []
    real_sort = torch.sort

    def recording_sort(values, *args, **kwargs):
        sizes.append(values.numel())
        return real_sort(values, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", recording_sort)
    for uniform in (0.0, 0.3, 0.9):
        scan_torch(logits, temperature=0.7, top_p=0.9, uniform=uniform)
        scan_torch(logits, temperature=1.0, top_k=40, uniform=uniform)
    assert sizes and max(sizes) <= SAMPLING_HEADS[-1]
    sizes.clear()
    scan_torch(torch.zeros(49152), temperature=1.0, uniform=0.9)  # flat: the draw lies past every head
    assert max(sizes) == 49152


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kw", [dict(uniform=0.5), dict(top_p=0.9, uniform=0.99), dict(top_k=5, uniform=0.3)])
def test_a_sampled_scan_of_bad_logits_names_the_problem(bad, kw):
    logits = torch.randn(5000)
    logits[1234] = bad  # a vocabulary larger than the first head: the draw is looked for there first
    with pytest.raises(ValueError, match=r"^scan: the logit of token 1234 is (NaN|\+inf): no distribution can be read"):
        scan_torch(logits, temperature=0.8, **kw)
    with pytest.raises(ValueError, match="no finite logit"):
        scan_torch(torch.full((5000,), float("-inf")), temperature=0.8, **kw)


def _every_scan():
    """The scan implementations this machine runs, by name (the CPU kernel and the OpenAI Triton kernel under its
    interpreter where they are available)."""
    scans = {name: get_scan(name) for name in ("numpy", "torch", "onnxruntime")}
    try:
        from prepos.scan_cpu import CpuKernelScan, CpuKernelUnavailable

        scans["cpu"] = CpuKernelScan()
    except CpuKernelUnavailable:
        pass
    try:
        from prepos.scan_triton import TritonScan

        if torch.cuda.is_available():  # the compiled kernel, the one that serves
            on_cuda = TritonScan("cuda", block=16)
            scans["triton"] = lambda logits, **kw: on_cuda(logits.to("cuda"), **kw)
        else:  # the same kernel under Triton's interpreter
            scans["triton"] = TritonScan("cpu", block=16)
    except (ImportError, RuntimeError):  # no Triton, or it runs compiled in this process
        pass
    return scans


@pytest.mark.parametrize("name", sorted(_every_scan()))
def test_every_scan_gives_ties_to_the_lowest_id_whatever_the_order_the_allowed_ids_come_in(name):
    """A choices trie lists a node's children in id order and its terminator last: on an exact tie the reference
    (first in the listed order) and ONNX Runtime (lowest id) answered differently."""
    scan = _every_scan()[name]
    logits = np.full(100, -1.0, dtype=np.float32)
    logits[[20, 2, 70]] = 5.0
    for allowed in ([20, 2], [70, 20, 9, 2], list(range(99, -1, -1))):
        got = scan(torch.from_numpy(logits), allowed_ids=allowed)
        assert got.token_id == 2, (name, allowed)
    # sampled: probability descending, id ascending on ties: a draw near 0 picks the lowest id of the tie
    got = scan(torch.from_numpy(logits), allowed_ids=[70, 20, 2], temperature=1.0, uniform=0.01)
    assert got.token_id == 2


@pytest.mark.parametrize("name", sorted(_every_scan()))
@pytest.mark.parametrize("bad, problem", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_every_scan_refuses_a_nan_or_infinite_logit_naming_its_token(name, bad, problem):
    """The OpenAI Triton kernel passed over a NaN as if masked and answered with full certainty; the others said
    "no finite logit" of logits that were all finite but one."""
    scan = _every_scan()[name]
    logits = torch.randn(100, generator=torch.Generator().manual_seed(5))
    logits[77] = bad  # in a later part of the Triton kernel's 16-logit parts
    message = rf"^scan: the logit of token 77 is {problem}: no distribution can be read from these logits$"
    for kw in (dict(), dict(allowed_ids=[3, 77, 40]), dict(temperature=0.8, uniform=0.5)):
        with pytest.raises(ValueError, match=message):
            scan(logits, **kw)
    assert scan(logits, allowed_ids=[3, 40]).token_id in (3, 40)  # the bad token not allowed: answered
    with pytest.raises(ValueError, match="^scan: no finite logit among the allowed tokens$"):
        scan(torch.full((100,), float("-inf")))


def test_the_reference_refuses_allowed_ids_it_cannot_index_naming_them():
    logits = np.zeros(10, dtype=np.float32)
    for allowed, problem in (([-1], r"must lie in \[0, 10\)"), ([10], r"must lie in \[0, 10\)"), ([3, 3], "repeated"),
                             ([], "non-empty")):
        with pytest.raises(ValueError, match=f"^allowed_ids: .*{problem}"):
            scan_numpy(logits, allowed_ids=allowed)
