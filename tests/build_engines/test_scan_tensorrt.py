"""The TensorRT scan: the plugin's maths agree with the NumPy reference (on CPU, everywhere); building
and running the engine needs TensorRT and a CUDA device and skips without them."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scan_cases import CASE, check_against_reference, make_logits
from prepos.scan import scan_numpy
from prepos_build import scan_tensorrt
from prepos_build.scan_tensorrt import TensorRTUnavailable, scan_tensors

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
needs_tensorrt = pytest.mark.skipif(not (HAS_TENSORRT and torch.cuda.is_available()),
                                    reason="needs TensorRT 10.6+ (tensorrt.plugin) and a CUDA device")


def _plugin_scan(logits: np.ndarray, allowed, temperature, top_k, top_p, u, device="cpu"):
    mask = torch.zeros(len(logits), dtype=torch.bool)
    mask[allowed if allowed is not None else slice(None)] = True
    token, p_max, margin, entropy = scan_tensors(torch.from_numpy(logits).to(device), mask.to(device), temperature,
                                                 top_k, torch.tensor([top_p], device=device),
                                                 torch.tensor([u], device=device))
    assert token.dtype == torch.int64 and token.shape == p_max.shape == margin.shape == entropy.shape == (1,)
    return int(token), float(p_max), float(margin), float(entropy)


@settings(max_examples=50, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float16]), **CASE)
def test_plugin_maths_agree_with_reference(vocab, seed, dtype, ties, masked, temperature, top_k, top_p, u):
    logits, allowed = make_logits(vocab, seed, ties, masked, dtype)
    kw = dict(allowed_ids=allowed, temperature=temperature, top_k=top_k, top_p=top_p, uniform=u)
    check_against_reference(logits, kw, _plugin_scan(logits, allowed, temperature, top_k, top_p, u))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.gpu
@settings(max_examples=50, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float16]), **CASE)
def test_plugin_maths_on_cuda_agree_with_reference(vocab, seed, dtype, ties, masked, temperature, top_k, top_p, u):
    """On CUDA a greedy scan goes through the Triton kernel, sampling through torch; both agree."""
    logits, allowed = make_logits(vocab, seed, ties, masked, dtype)
    kw = dict(allowed_ids=allowed, temperature=temperature, top_k=top_k, top_p=top_p, uniform=u)
    check_against_reference(logits, kw, _plugin_scan(logits, allowed, temperature, top_k, top_p, u, "cuda"))


def test_greedy_ties_and_single_token():
    assert _plugin_scan(np.array([0.0, 3.0, 3.0], np.float32), None, 0.0, 0, 1.0, 0.0)[0] == 1
    assert _plugin_scan(np.array([5.0], np.float32), None, 0.0, 0, 1.0, 0.0) == (0, 1.0, 1.0, 0.0)


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here")
def test_without_tensorrt_the_build_fails_with_a_clear_reason(tmp_path, capsys):
    assert scan_tensorrt.main(["--output", str(tmp_path)]) == 2
    assert "TensorRT 10.6+ with tensorrt.plugin is not installed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    with pytest.raises(TensorRTUnavailable):
        scan_tensorrt.TensorRTScan(tmp_path / "scan.engine")


def test_bad_vocab_bounds_are_refused_before_tensorrt_is_needed(tmp_path, capsys):
    with pytest.raises(ValueError, match="opt_vocab"):
        scan_tensorrt.build_engine(tmp_path / "x.engine", max_vocab=10, opt_vocab=11)
    # on the command line, each flag named as given (--max-vocab 0 blamed opt_vocab)
    for argv, problem in ((["--max-vocab", "0"], "--max-vocab: must be >= 1, got 0"),
                          (["--max-vocab", "10", "--opt-vocab", "11"], "--opt-vocab: must lie in [1, --max-vocab 10]")):
        with pytest.raises(SystemExit) as exited:
            scan_tensorrt.main(["--output", str(tmp_path), *argv])
        assert exited.value.code == 2
        assert problem in capsys.readouterr().err


@pytest.mark.gpu
@needs_tensorrt
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_engine_answers_as_the_reference(tmp_path, dtype):
    path = scan_tensorrt.build_engine(tmp_path / f"scan_{dtype}.engine", dtype, max_vocab=160_000, opt_vocab=49_152)
    scan = scan_tensorrt.TensorRTScan(path)
    rng = np.random.default_rng(0)
    for vocab in (7, 49_152, 151_936):
        logits = rng.normal(0, 4, vocab).astype(dtype)
        cuda = torch.from_numpy(logits).cuda()
        for kw in ({}, {"allowed_ids": [1, 3, 5]}, {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "uniform": 0.3}):
            ref, got = scan_numpy(logits, **kw), scan(cuda, **kw)
            assert got.token_id == ref.token_id and got.num_allowed == ref.num_allowed
            for name in ("p_max", "margin", "entropy"):
                assert math.isclose(getattr(got, name), getattr(ref, name), rel_tol=1e-4, abs_tol=1e-5), name
    with pytest.raises(ValueError, match="no finite logit"):
        scan(torch.full((4,), float("-inf"), dtype=getattr(torch, dtype), device="cuda"))


def test_plugin_functions_follow_the_tensorrt_plugin_signature_rules(monkeypatch):
    """Against a stand-in for ``tensorrt.plugin``: the rules its ``register``/``impl`` decorators check."""
    import inspect
    import sys
    import types
    import typing

    class TensorDesc:
        pass

    class Tensor:
        pass

    seen = {}
    trt = types.ModuleType("tensorrt")
    trtp = types.ModuleType("tensorrt.plugin")
    trt.plugin, trt.int64, trt.float32 = trtp, "int64", "float32"
    trtp.TensorDesc, trtp.Tensor = TensorDesc, Tensor
    trtp.from_shape_expr = lambda shape, dtype: (tuple(shape), dtype)
    trtp.register = lambda plugin_id: lambda fn: seen.setdefault("register", (plugin_id, fn))
    trtp.impl = lambda plugin_id: lambda fn: seen.setdefault("impl", (plugin_id, fn))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(scan_tensorrt, "_registered", False)
    scan_tensorrt.register_plugin()

    plugin_id, describe = seen["register"]
    assert plugin_id == "prepos::VocabScan"
    sig = inspect.signature(describe)
    assert list(sig.parameters) == list(scan_tensorrt.INPUT_NAMES)
    assert all(isinstance(p.annotation, type) and issubclass(p.annotation, TensorDesc) for p in sig.parameters.values())
    assert typing.get_origin(sig.return_annotation) is tuple
    assert [issubclass(a, TensorDesc) for a in typing.get_args(sig.return_annotation)] == [True] * 4
    assert describe(*[TensorDesc()] * 6) == (((1,), "int64"),) + (((1,), "float32"),) * 3

    plugin_id, run = seen["impl"]
    sig = inspect.signature(run)
    assert plugin_id == "prepos::VocabScan"
    assert list(sig.parameters) == list(scan_tensorrt.INPUT_NAMES) + ["outputs", "stream"]
    assert [issubclass(a, Tensor) for a in typing.get_args(sig.parameters["outputs"].annotation)] == [True] * 4
    assert sig.parameters["stream"].annotation is int and sig.return_annotation is None
