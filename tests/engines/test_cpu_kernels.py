"""The CPU kernels (decode's GEMV and one token's attention, prefill's GEMM and causal attention): build and cache,
checks, results against torch, and the engine on them."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from prepos.engines import cpu_kernels
from prepos.engines.torch_llama import TorchLlamaEngine

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler on PATH: the kernel cannot be built here")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    built = cpu_kernels.load(tmp_path_factory.mktemp("cache"))
    assert built is not None, "the kernels did not build or failed their self-test (see the log)"
    return built


def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    return saved


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("blocks, k", [(1, 1), (4, 64), (7, 33), (96, 576)])
def test_gemv_matches_torch(kernels, threads, blocks, k):
    g = torch.Generator().manual_seed(blocks * 1000 + k)
    w = torch.randn(blocks, k, 32, generator=g)
    x, res = torch.randn(k, generator=g), torch.randn(blocks * 32, generator=g)
    want = torch.bmm(x.expand(blocks, 1, k), w).view(-1)
    saved = _threads(threads)
    try:
        plain, scaled = kernels.gemv(w, x), kernels.gemv(w, x, alpha=-0.25, residual=res)
    finally:
        torch.set_num_threads(saved)
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.allclose(plain, want, **tol)
    assert torch.allclose(scaled, res - 0.25 * want, **tol)


def test_gemv_reads_the_residual_and_does_not_write_it(kernels):
    w, x = torch.ones(2, 3, 32), torch.ones(3)
    res = torch.arange(64, dtype=torch.float32)
    before = res.clone()
    y = kernels.gemv(w, x, residual=res)
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
def test_gemv_refuses_bad_input_by_name(kernels, w, x, res, field):
    with pytest.raises(ValueError, match=f"^{field}: need a contiguous float32 CPU tensor"):
        kernels.gemv(w, x, residual=res)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n, blocks, k", [(1, 3, 40), (2, 1, 1), (7, 4, 33), (8, 2, 64), (9, 5, 17), (64, 3, 65),
                                          (65, 2, 576), (130, 18, 576), (40, 96, 576)])
def test_gemm_matches_torch(kernels, threads, n, blocks, k):
    """Full tiles, tails, one row and several panels of rows, against torch's matmul."""
    g = torch.Generator().manual_seed(n * 100_000 + blocks * 1000 + k)
    w, x = torch.randn(blocks, k, 32, generator=g), torch.randn(n, k, generator=g)
    scale, res = torch.rand(n, generator=g) + 0.5, torch.randn(n, blocks * 32, generator=g)
    want = torch.matmul(x, w).transpose(0, 1).reshape(n, blocks * 32)
    saved = _threads(threads)
    try:
        plain, full = kernels.gemm(w, x), kernels.gemm(w, x, scale=scale, residual=res)
    finally:
        torch.set_num_threads(saved)
    tol = dict(rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.allclose(plain, want, **tol)
    assert torch.allclose(full, res + scale[:, None] * want, **tol)


def test_gemm_rows_and_columns_land_in_place(kernels):
    """A one-hot input row picks one row of W: every output lands at its own row and column."""
    n, blocks, k = 11, 3, 10
    w = torch.arange(blocks * k * 32, dtype=torch.float32).view(blocks, k, 32)
    x = torch.zeros(n, k)
    x[torch.arange(n), torch.arange(n) % k] = 1.0
    y = kernels.gemm(w, x)
    for r in range(n):
        assert y[r].equal(w[:, r % k, :].reshape(-1)), r


@pytest.mark.parametrize("w, x, scale, res, field", [
    (torch.ones(2, 3, 16), torch.ones(4, 3), None, None, "w"),
    (torch.ones(2, 3, 32), torch.ones(4, 5), None, None, "x"),
    (torch.ones(2, 3, 32), torch.ones(3), None, None, "x"),  # one vector: that is the GEMV
    (torch.ones(2, 3, 32), torch.ones(3, 4).t(), None, None, "x"),  # not contiguous
    (torch.ones(2, 3, 32), torch.ones(4, 3, dtype=torch.float64), None, None, "x"),
    (torch.ones(2, 3, 32), torch.ones(4, 3), torch.ones(3), None, "scale"),
    (torch.ones(2, 3, 32), torch.ones(4, 3), None, torch.ones(4, 32), "residual"),
    (torch.ones(2, 3, 32), torch.ones(4, 3), None, torch.ones(64, 4).t(), "residual"),
])
def test_gemm_refuses_bad_input_by_name(kernels, w, x, scale, res, field):
    with pytest.raises(ValueError, match=f"^{field}: need a contiguous float32 CPU tensor"):
        kernels.gemm(w, x, scale=scale, residual=res)


def test_build_is_cached_and_keyed(tmp_path, monkeypatch):
    first = cpu_kernels.load(tmp_path)
    built = sorted(tmp_path.iterdir())
    assert first is not None and [p.name for p in built] == [first.path.name]
    stamp = first.path.stat().st_mtime_ns
    again = cpu_kernels.load(tmp_path)
    assert again.path == first.path and again.path.stat().st_mtime_ns == stamp  # reused, not rebuilt
    monkeypatch.setattr(cpu_kernels, "FLAGS", (*cpu_kernels.FLAGS, "-DPREPOS_TEST_KEY"))
    other = cpu_kernels.load(tmp_path)
    assert other.path != first.path and len(list(tmp_path.iterdir())) == 2  # new flags, new library


def test_loading_the_kernels_leaves_subnormal_floats_alone(tmp_path):
    """The library is not linked with -ffast-math's start-up code, which would flush subnormals to zero in the
    process that loads it (numpy, torch and everything else in it). In a child process: the mode is per process."""
    script = textwrap.dedent(f"""
        import numpy as np
        from pathlib import Path
        from prepos.engines import cpu_kernels
        tiny = np.float32(1e-40)  # subnormal in float32
        assert tiny * np.float32(1.0) != 0
        assert cpu_kernels.load(Path({str(tmp_path)!r})) is not None
        print(float(tiny * np.float32(1.0)))  # 0.0 once subnormals are flushed (or read as zero)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) > 0  # after the load, still not flushed to zero


def test_no_compiler_or_a_failing_one_gives_none(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="prepos.engines.cpu_kernels")
    monkeypatch.setenv("CC", "prepos-no-such-compiler")
    assert cpu_kernels.load(tmp_path) is None
    assert "no C compiler" in caplog.text
    broken = tmp_path / "bin" / "cc"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert cpu_kernels.load(tmp_path / "cache") is None
    assert "broken compiler" in caplog.text
    assert not any((tmp_path / "cache").glob("*.so"))  # no half-written library left behind


@pytest.mark.parametrize("kernel, bug, wrong", [
    ("gemv", "alpha * (a[j] + b[j])", "alpha * a[j]"),  # drops every other row
    ("attention", "o[d] /= l;", "o[d] /= l + 1e-3f;"),
    ("gemm", "r0 += GEMM_ROWS)", "r0 += GEMM_ROWS + 1)"),  # skips a row after each full tile
    ("prefill attention", "lim = start + i0 + r / group + 1 - j0;", "lim = start + i0 + r / group + 2 - j0;"),  # a key too far
])
def test_a_wrong_kernel_fails_the_self_test(tmp_path, monkeypatch, caplog, kernel, bug, wrong):
    source = tmp_path / "cpu_kernels.c"
    source.write_text(cpu_kernels.SOURCE.read_text().replace(bug, wrong))
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    assert cpu_kernels.load(tmp_path / "cache") is None
    assert f"self-test: {kernel} wrong" in caplog.text


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv_heads, group, head_dim, n", [
    (1, 1, 8, 1), (2, 3, 64, 255), (2, 3, 64, 256), (2, 3, 64, 257),  # around one chunk of keys
    (3, 3, 64, 1000), (8, 4, 128, 600), (1, 16, 256, 40),
])
def test_attention_matches_sdpa(kernels, threads, kv_heads, group, head_dim, n):
    g = torch.Generator().manual_seed(n * 7 + group)
    q = torch.randn(kv_heads, group, head_dim, generator=g) * 3  # peaked softmax: a wrong max would show
    cache = torch.randn(2, kv_heads, n + 9, head_dim, generator=g)[:, :, :n]  # spare capacity between heads
    want = F.scaled_dot_product_attention(q[None], cache[0][None], cache[1][None]).reshape(-1)
    saved = _threads(threads)
    try:
        got = kernels.attend(q, cache[0], cache[1])
    finally:
        torch.set_num_threads(saved)
    assert got.shape == (kv_heads * group * head_dim,)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("q, k, v, problem", [
    (torch.ones(2, 17, 8), torch.ones(2, 5, 8), torch.ones(2, 5, 8), "group 17"),
    (torch.ones(1, 1, 512), torch.ones(1, 5, 512), torch.ones(1, 5, 512), "head_dim 512"),
    (torch.ones(2, 8, 3).transpose(1, 2), torch.ones(2, 5, 8), torch.ones(2, 5, 8), "q: must be contiguous"),
    (torch.ones(2, 3, 8), torch.ones(2, 5, 8, dtype=torch.float64), torch.ones(2, 5, 8), "k: need float32"),
    (torch.ones(2, 3, 8), torch.ones(2, 5, 8), torch.ones(2, 4, 8), r"v: need \[2, n >= 1, 8\]"),
    (torch.ones(2, 3, 8), torch.ones(2, 8, 5).transpose(1, 2), torch.ones(2, 5, 8), "k: need"),  # rows not contiguous
    (torch.ones(2, 3, 8), torch.ones(2, 0, 8), torch.ones(2, 0, 8), "k: need"),
    (torch.ones(2, 3, 8), torch.ones(2, 9, 8)[:, :5], torch.ones(2, 5, 8), "head strides differ"),
])
def test_attention_refuses_bad_input_by_name(kernels, q, k, v, problem):
    with pytest.raises(ValueError, match=problem):
        kernels.attend(q, k, v)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv_heads, group, head_dim, start, n", [
    (1, 1, 32, 0, 1), (2, 3, 64, 0, 40), (3, 3, 64, 300, 40),  # SmolLM2's shape: a question's turn over a prefix
    (2, 3, 64, 0, 130), (1, 2, 32, 63, 1), (1, 2, 32, 64, 1), (2, 1, 32, 10, 55),  # around a chunk of 64 keys
    (1, 16, 256, 5, 4), (2, 4, 128, 700, 17),
])
def test_prefill_attention_matches_sdpa(kernels, threads, kv_heads, group, head_dim, start, n):
    g = torch.Generator().manual_seed(start * 31 + n * 7 + group)
    qk = torch.randn(n, kv_heads * group + kv_heads, head_dim, generator=g) * 3  # q and k side by side, as in prefill
    q = qk[:, : kv_heads * group]
    cache = torch.randn(2, kv_heads, start + n + 9, head_dim, generator=g)[:, :, : start + n]
    saved = _threads(threads)
    try:
        got = kernels.prefill_attend(q, cache[0], cache[1])
    finally:
        torch.set_num_threads(saved)
    want = cpu_kernels.causal_attention_reference(q, cache[0], cache[1])
    assert got.shape == (n, kv_heads * group * head_dim)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_prefill_attention_is_causal(kernels):
    """Changing a later key or value changes no earlier token's output, and does change that token's."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(20, 3, 32, generator=g)
    cache = torch.randn(2, 1, 30, 32, generator=g)  # 10 cached, 20 new
    before = kernels.prefill_attend(q, cache[0], cache[1])
    cache[:, :, 22] += 5.0  # position 22: new token 12
    after = kernels.prefill_attend(q, cache[0], cache[1])
    assert after[:12].equal(before[:12])
    assert not torch.allclose(after[12], before[12])


def test_prefill_attention_scratch_is_rewritten_on_each_call(kernels):
    """One scratch serves every layer of a prefill: whatever an earlier call (or nothing) left in it, each call
    transposes its own keys, padding included, and gives the reference result."""
    g = torch.Generator().manual_seed(5)
    kv_heads, group, head_dim, start, n = 2, 3, 64, 100, 30  # 130 keys: the last chunk of 64 is padded
    scratch = cpu_kernels.prefill_scratch(kv_heads, head_dim, 400)  # sized for a longer prefill, as reuse allows
    scratch.fill_(float("nan"))
    for layer in range(3):
        q = torch.randn(n, kv_heads * group, head_dim, generator=g)
        cache = torch.randn(2, kv_heads, start + n, head_dim, generator=g) * (layer + 1)
        got = kernels.prefill_attend_unchecked(q, q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(), kv_heads,
                                               group, head_dim, n, start, cache.stride(1), scratch)
        want = cpu_kernels.causal_attention_reference(q, cache[0], cache[1])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"layer {layer}"


@pytest.mark.parametrize("q, k, v, problem", [
    (torch.ones(4, 6, 48), torch.ones(2, 4, 48), torch.ones(2, 4, 48), "head_dim a multiple of 32"),
    (torch.ones(4, 5, 32), torch.ones(2, 4, 32), torch.ones(2, 4, 32), "5 heads over 2 kv heads"),
    (torch.ones(4, 34, 32), torch.ones(2, 4, 32), torch.ones(2, 4, 32), "group of at most 16"),
    (torch.ones(6, 4, 32)[::2], torch.ones(2, 3, 32), torch.ones(2, 3, 32), None),  # tokens further apart: fine
    (torch.ones(4, 32, 4).transpose(1, 2), torch.ones(2, 4, 32), torch.ones(2, 4, 32), "heads must be contiguous"),
    (torch.ones(4, 4, 32), torch.ones(2, 3, 32), torch.ones(2, 3, 32), "^k: need .* at least 4 keys"),
    (torch.ones(4, 4, 32), torch.ones(2, 4, 32), torch.ones(2, 5, 32), "^v: need"),
    (torch.ones(4, 4, 32), torch.ones(2, 4, 32, dtype=torch.float16), torch.ones(2, 4, 32), "^k: need float32"),
    (torch.ones(4, 4, 32), torch.ones(2, 9, 32)[:, :4], torch.ones(2, 4, 32), "head strides differ"),
])
def test_prefill_attention_refuses_bad_input_by_name(kernels, q, k, v, problem):
    if problem is None:
        assert kernels.prefill_attend(q, k, v).shape == (3, 4 * 32)
        return
    with pytest.raises(ValueError, match=problem):
        kernels.prefill_attend(q, k, v)


@pytest.mark.parametrize("fused", [True, False], ids=["all-layers-call", "call-per-op"])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_engine_on_the_kernel_matches_torch_matmul(which, threads, fused, request):
    path, model = request.getfixturevalue(which)
    saved = torch.get_num_threads()
    try:
        kernel = TorchLlamaEngine(path, num_threads=threads)
        plain = TorchLlamaEngine(path, num_threads=threads, cpu_kernels=False)
        assert kernel.products.kernels is not None and kernel.products.kernel_attention
        assert plain.products.kernels is None
        assert kernel.products.decode_layers is not None and plain.products.decode_layers is None
        if not fused:
            kernel.products.decode_layers = None  # the GEMV and attention kernels called op by op
        p = kernel.products
        matrices = (p.wqkv[0], p.wo[0], p.wgu[0], p.wdown[0], p.lm_head)
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


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_engine_prefill_on_the_kernels_matches_torch_and_transformers(tie, tmp_path):
    """Prefill of many rows (several GEMM tiles and panels, tails; more keys than one chunk of the attention)
    and then an extension over that prefix, in a model shaped like SmolLM2's heads (3 query heads per kv head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    torch.manual_seed(9)
    model = LlamaForCausalLM(config).eval()
    path = str(tmp_path)
    model.save_pretrained(path, safe_serialization=True)
    kernel, plain = TorchLlamaEngine(path), TorchLlamaEngine(path, cpu_kernels=False)
    assert kernel.products.on_gemv_kernel(kernel.products.wgu[0])
    assert not plain.products.on_gemv_kernel(plain.products.wgu[0])
    assert kernel.products.kernel_prefill_attention and not plain.products.kernel_prefill_attention
    ids = torch.randint(0, config.vocab_size, (83,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0]
    for end in (70, 83):  # 70 from nothing, then 13 more over the cached 70
        got, want = kernel.prefill("s", ids[:end]), plain.prefill("s", ids[:end])
        assert torch.allclose(got, want, atol=1e-5)
        assert (got - hf[end - 1]).abs().max().item() <= 1e-4
    assert list(kernel.cached_token_ids("s")) == ids
    # Two sessions decoding as one batch: GEMM rows and the decode attention kernel against torch's ops.
    for engine in (kernel, plain):
        engine.prefill("t", ids[:40])
    for token_s, token_t in zip(ids[50:54], ids[60:64]):
        got, want = (e.decode_batch(["s", "t"], [token_s, token_t]) for e in (kernel, plain))
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    assert list(kernel.cached_token_ids("t")) == [*ids[:40], *ids[60:64]]
    # Three sessions prefilling as one batch: GEMM rows of all, the attention kernel per session over its own KV.
    for engine in (kernel, plain):
        engine.truncate("s", 30)
    batch = [("s", ids[:77]), ("t", [*ids[:40], *ids[60:64], *ids[10:19]]), ("u", ids[5:60])]
    got, want = (e.prefill_batch([sid for sid, _ in batch], [seq for _, seq in batch]) for e in (kernel, plain))
    assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))
    for (sid, seq), logits in zip(batch, got):
        with torch.no_grad():
            assert (logits - model(torch.tensor([seq])).logits[0, -1]).abs().max().item() <= 1e-4, sid
        assert list(kernel.cached_token_ids(sid)) == seq


def test_engine_keeps_torch_matmul_off_float32(tied):
    path, _ = tied
    assert TorchLlamaEngine(path, dtype="bfloat16").products.kernels is None


def test_engine_decode_past_several_key_chunks(tmp_path):
    """Decode attention over more keys than one work item holds (and a KV that has grown) matches SDPA's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path), safe_serialization=True)
    kernel = TorchLlamaEngine(str(tmp_path), kv_block_tokens=128)
    plain = TorchLlamaEngine(str(tmp_path), kv_block_tokens=128, cpu_kernels=False)
    assert kernel.products.decode_layers is not None  # vocab 300 keeps the lm_head off the kernel; the layers are on it
    ids = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    kernel.prefill("s", ids[:600])
    plain.prefill("s", ids[:600])
    for token in ids[600:]:  # crosses KV capacity 640: the cache regrows under the kernel
        assert torch.allclose(kernel.decode("s", token), plain.decode("s", token), atol=1e-5)
    assert kernel._sessions["s"].kv.shape[3] == 768


def test_decode_layers_refuses_matrices_it_cannot_read(kernels, tied):
    path, _ = tied
    saved = torch.get_num_threads()
    try:  # on one thread cpu_chunks keeps each matrix whole: [1, in, out]
        engine = TorchLlamaEngine(path, num_threads=1, cpu_kernels=False)
    finally:
        torch.set_num_threads(saved)
    dims = dict(heads=engine.n_heads, kv_heads=engine.n_kv_heads, head_dim=engine.head_dim,
                inter=engine.intermediate, n_eps=engine.products.n_eps)
    w = engine.products
    with pytest.raises(ValueError, match="need .* float32 contiguous"):
        cpu_kernels.DecodeLayers(kernels, w.wqkv, w.wo, w.wgu, w.wdown, **dims)
    packed = TorchLlamaEngine(path).products
    with pytest.raises(ValueError, match="outside what the attention kernel takes"):
        cpu_kernels.DecodeLayers(kernels, packed.wqkv, packed.wo, packed.wgu, packed.wdown, **{**dims, "kv_heads": 3})


def test_engine_decode_batch_in_one_kernel_call_matches_op_by_op(tmp_path):
    """A decode batch through prepos_decode_layers_batch: sessions at different positions (one past several
    chunks of keys), KV of different capacities, one growing on the way; against the same batch op by op
    (GEMM and attention kernels) and against torch's ops."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(4)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path), safe_serialization=True)
    fused, by_op = TorchLlamaEngine(str(tmp_path), kv_block_tokens=64), TorchLlamaEngine(str(tmp_path), kv_block_tokens=64)
    plain = TorchLlamaEngine(str(tmp_path), kv_block_tokens=64, cpu_kernels=False)
    by_op.products.decode_layers = None
    calls = []
    batch = fused.products.decode_layers.batch
    fused.products.decode_layers.batch = lambda *a: calls.append(len(a[1])) or batch(*a)
    ids = torch.randint(0, 320, (700,), generator=torch.Generator().manual_seed(8)).tolist()
    lengths = {"a": 5, "b": 62, "c": 600}  # b's KV grows past 64 on the way; c attends over 3 chunks of 256
    for engine in (fused, by_op, plain):
        for sid, n in lengths.items():
            engine.prefill(sid, ids[:n])
    for step in range(4):
        tokens = [ids[n + step] for n in lengths.values()]
        got, op, want = (e.decode_batch(list(lengths), tokens) for e in (fused, by_op, plain))
        for sid, g, o, w in zip(lengths, got, op, want):
            assert torch.allclose(g, o, atol=1e-5) and torch.allclose(g, w, atol=1e-4), (step, sid)
    assert calls == [3] * 4
    assert fused._sessions["b"].kv.shape[3] == 128
    assert [list(fused.cached_token_ids(sid)) for sid in lengths] == [ids[:n + 4] for n in lengths.values()]
