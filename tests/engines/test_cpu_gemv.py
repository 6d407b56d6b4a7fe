"""The CPU decode GEMV kernel: build and cache, checks, results against torch, and the engine on it."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from prepos.engines import cpu_gemv
from prepos.engines.torch_llama import TorchLlamaEngine

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler on PATH: the kernel cannot be built here")


@pytest.fixture(scope="module")
def gemv(tmp_path_factory):
    kernel = cpu_gemv.load(tmp_path_factory.mktemp("cache"))
    assert kernel is not None, "the kernel did not build or failed its self-test (see the log)"
    return kernel


def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return saved


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("blocks, k", [(1, 1), (4, 64), (7, 33), (96, 576)])
def test_matches_torch(gemv, threads, blocks, k):
    g = torch.Generator().manual_seed(blocks * 1000 + k)
    w = torch.randn(blocks, k, 32, generator=g)
    x, res = torch.randn(k, generator=g), torch.randn(blocks * 32, generator=g)
    want = torch.bmm(x.expand(blocks, 1, k), w).view(-1)
    saved = _threads(threads)
    try:
        plain, scaled = gemv(w, x), gemv(w, x, alpha=-0.25, residual=res)
    finally:
        torch.set_num_threads(saved)
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.allclose(plain, want, **tol)
    assert torch.allclose(scaled, res - 0.25 * want, **tol)


def test_residual_is_read_not_written(gemv):
    w, x = torch.ones(2, 3, 32), torch.ones(3)
    res = torch.arange(64, dtype=torch.float32)
    before = res.clone()
    y = gemv(w, x, residual=res)
    assert res.equal(before) and y.equal(before + 3)


@pytest.mark.parametrize("w, x, res, field", [
    (torch.ones(2, 3, 16), torch.ones(3), None, "w"),  # blocks of 16 columns
    (torch.ones(2, 3, 32, dtype=torch.float64), torch.ones(3), None, "w"),
    (torch.ones(2, 32, 3).transpose(1, 2), torch.ones(3), None, "w"),  # not contiguous
    (torch.ones(2, 3, 32), torch.ones(4), None, "x"),
    (torch.ones(2, 3, 32), torch.ones(6)[::2], None, "x"),
    (torch.ones(2, 3, 32), torch.ones(3), torch.ones(32), "residual"),
    (torch.ones(2, 3, 32), torch.ones(3), torch.ones(64, dtype=torch.float16), "residual"),
])
def test_bad_input_is_refused_by_name(gemv, w, x, res, field):
    with pytest.raises(ValueError, match=f"^{field}: need a contiguous float32 CPU tensor"):
        gemv(w, x, residual=res)


def test_build_is_cached_and_keyed(tmp_path, monkeypatch):
    first = cpu_gemv.load(tmp_path)
    built = sorted(tmp_path.iterdir())
    assert first is not None and [p.name for p in built] == [first.path.name]
    stamp = first.path.stat().st_mtime_ns
    again = cpu_gemv.load(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    monkeypatch.setattr(cpu_gemv, "FLAGS", (*cpu_gemv.FLAGS, "-DPREPOS_TEST_KEY"))
    other = cpu_gemv.load(tmp_path)
    assert other.path != first.path and len(list(tmp_path.iterdir())) == 2  # new flags, new library


def test_no_compiler_or_a_failing_one_gives_none(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="prepos.engines.cpu_gemv")
    monkeypatch.setenv("CC", "prepos-no-such-compiler")
    assert cpu_gemv.load(tmp_path) is None
    assert "no C compiler" in caplog.text
    broken = tmp_path / "bin" / "cc"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert cpu_gemv.load(tmp_path / "cache") is None
    assert "broken compiler" in caplog.text
    assert not any((tmp_path / "cache").glob("*.so"))  # no half-written library left behind


def test_a_wrong_kernel_fails_the_self_test(tmp_path, monkeypatch, caplog):
    source = tmp_path / "cpu_gemv.c"
    source.write_text(cpu_gemv.SOURCE.read_text().replace("alpha * (a[j] + b[j])", "alpha * a[j]"))
    monkeypatch.setattr(cpu_gemv, "SOURCE", source)
    assert cpu_gemv.load(tmp_path / "cache") is None
    assert "self-test" in caplog.text


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_engine_on_the_kernel_matches_torch_matmul(which, threads, request):
    path, model = request.getfixturevalue(which)
    saved = torch.get_num_threads()
    try:
        kernel = TorchLlamaEngine(path, num_threads=threads)
        plain = TorchLlamaEngine(path, num_threads=threads, cpu_kernels=False)
        assert kernel._gemv is not None and plain._gemv is None
        matrices = (kernel.wqkv[0], kernel.wo[0], kernel.wgu[0], kernel.wdown[0], kernel.lm_head)
        assert [tuple(w.shape[::2]) for w in matrices] == [(4, 32), (2, 32), (8, 32), (2, 32), (16, 32)]
        ids = [3, 14, 159, 26, 5, 358, 97, 93]
        with torch.no_grad():
            hf = model(torch.tensor([ids])).logits[0]
        assert torch.allclose(kernel.prefill("s", ids[:4]), plain.prefill("s", ids[:4]), atol=1e-5)
        for n in range(4, len(ids)):
            got, want = kernel.decode("s", ids[n]), plain.decode("s", ids[n])
            assert torch.allclose(got, want, atol=1e-5)
            assert (got - hf[n]).abs().max().item() <= 1e-4
    finally:
        torch.set_num_threads(saved)


def test_engine_keeps_torch_matmul_off_float32(tied):
    path, _ = tied
    assert TorchLlamaEngine(path, dtype="bfloat16")._gemv is None
