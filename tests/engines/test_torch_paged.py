"""PagedTorchLlamaEngine (static paged KV pool, decode attention kernel, CUDA-graph decode) against
transformers and against the stateless forward.

Without a GPU the decode attention kernel runs under Triton's interpreter (see
tests/conftest.py) and the step runs eagerly; with one, the captured graph is checked too.
"""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("triton", reason="OpenAI Triton is not installed")

from prepos.engines.torch_llama import TorchLlamaEngine  # noqa: E402
from prepos.engines.torch_paged import KVPoolExhausted, PagedTorchLlamaEngine  # noqa: E402

from engines.test_torch_llama import _close, _hf_logits, _ids  # noqa: E402

PAGE = 4
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # compiled kernels need CUDA tensors; without a GPU they run interpreted
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _engine(path, **kw) -> PagedTorchLlamaEngine:
    kw.setdefault("device", DEVICE)
    return PagedTorchLlamaEngine(path, page_tokens=PAGE, splits=4, kv_pool_bytes=kw.pop("pool", 4 << 20), **kw)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_prefill_then_decode_match_hf_at_every_step_across_pages(which, request):
    path, model = request.getfixturevalue(which)
    engine = _engine(path)
    ids = _ids(9, seed=3)  # 9 tokens: the third page is part-filled
    assert _close(engine.prefill("s", ids).cpu(), _hf_logits(model, ids)[-1])
    for t in _ids(12, seed=4):  # crosses three page boundaries and uses more splits than pages at first
        ids.append(t)
        assert _close(engine.decode("s", t).cpu(), _hf_logits(model, ids)[-1])
    assert engine.cached_token_ids("s") == tuple(ids)
    assert engine.kv_bytes("s") == 6 * PAGE * engine.info.kv_bytes_per_token


def test_greedy_output_is_token_identical_to_a_stateless_prefill_with_sessions_interleaved(tied):
    path, _ = tied
    engine, stateless = _engine(path), TorchLlamaEngine(path, device=DEVICE)
    logs = {"a": _ids(7, seed=5), "b": _ids(13, seed=6)}
    last = {sid: engine.prefill(sid, log) for sid, log in logs.items()}
    for _ in range(10):
        for sid, log in logs.items():  # a and b alternate: the pool and the step's inputs are shared
            token = int(torch.argmax(last[sid]))
            log.append(token)
            last[sid] = engine.decode(sid, token)
            assert int(torch.argmax(last[sid])) == int(torch.argmax(stateless.prefill(f"x{len(log)}", log)))


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_decode_batch_matches_hf_for_each_session_across_pages_and_padding(which, request):
    """Three sessions of different lengths take each step as one batch (padded to 4 rows, which write and read
    only the scratch page) while their KV crosses page boundaries; each gets the logits a full forward of its
    own sequence gives, and the pages stay each session's own."""
    path, model = request.getfixturevalue(which)
    engine = _engine(path, max_batch=4)
    seqs = {"a": _ids(3, seed=20), "b": _ids(9, seed=21), "c": _ids(14, seed=22)}
    for sid, ids in seqs.items():
        ids.append(int(engine.prefill(sid, ids).argmax()))
    computed = engine.num_computed_tokens
    for _ in range(6):
        results = engine.decode_batch(list(seqs), [ids[-1] for ids in seqs.values()])
        for (sid, ids), logits in zip(seqs.items(), results):
            assert _close(logits.cpu(), _hf_logits(model, ids)[-1]), sid
            assert list(engine.cached_token_ids(sid)) == ids
            ids.append(int(logits.argmax()))
    assert engine.num_computed_tokens == computed + 6 * 3
    pages = [p for sid in seqs for p in engine._sessions[sid].pages]
    assert len(pages) == len(set(pages)) and 0 not in pages
    assert [engine.kv_bytes(sid) for sid in seqs] == [-(-(len(ids) - 1) // PAGE) * PAGE * engine.info.kv_bytes_per_token
                                                     for ids in seqs.values()]


def test_a_batch_larger_than_max_batch_is_taken_in_steps_with_the_same_answers(tied):
    path, _ = tied
    batched, alone = _engine(path, max_batch=2), _engine(path)
    seqs = {f"s{i}": _ids(2 + 3 * i, seed=30 + i) for i in range(5)}
    for sid, ids in seqs.items():
        batched.prefill(sid, ids)
        alone.prefill(sid, ids)
    tokens = _ids(5, seed=40)
    results = batched.decode_batch(list(seqs), tokens)
    for (sid, ids), token, logits in zip(seqs.items(), tokens, results):
        assert _close(logits.cpu(), alone.decode(sid, token).cpu()), sid
        assert list(batched.cached_token_ids(sid)) == [*ids, token]


def test_decode_batch_refuses_an_impossible_step_alone(tied):
    """A session without KV, a token past the vocabulary and a step the pool has no page for each fail alone;
    the others still decode and the failed sessions keep their KV and pages."""
    path, model = tied
    per_page = PAGE * TorchLlamaEngine(path).info.kv_bytes_per_token
    engine = _engine(path, pool=5 * per_page)  # 4 usable pages
    a, b, c = _ids(5, seed=23), _ids(4, seed=24), _ids(3, seed=25)
    for sid, ids in (("a", a), ("b", b), ("c", c)):
        engine.prefill(sid, ids)  # a: 2 pages, b and c: 1 each; b's next token needs a fifth page
    free = len(engine._free)
    results = engine.decode_batch(["a", "nosuch", "b", "c"], [7, 8, 9, 512])  # 512: past the vocabulary
    assert isinstance(results[1], ValueError) and "'nosuch' has no KV" in str(results[1])
    assert isinstance(results[2], KVPoolExhausted) and "KV pool exhausted" in str(results[2])
    assert isinstance(results[3], ValueError) and "token id 512" in str(results[3])
    assert _close(results[0].cpu(), _hf_logits(model, [*a, 7])[-1])
    assert list(engine.cached_token_ids("a")) == [*a, 7]
    assert list(engine.cached_token_ids("b")) == b and list(engine.cached_token_ids("c")) == c
    assert len(engine._free) == free == 0
    for sids, toks, problem in ((["a", "a"], [1, 2], "appears twice"), (["a", "b"], [1], "2 sessions but 1 tokens")):
        with pytest.raises(ValueError, match=problem):
            engine.decode_batch(sids, toks)
    assert list(engine.cached_token_ids("a")) == [*a, 7] and list(engine.cached_token_ids("b")) == b


def test_prefix_reuse_truncate_and_release_keep_pages_consistent(tied):
    path, model = tied
    engine = _engine(path)
    free = len(engine._free)
    ids = _ids(10, seed=7)
    engine.prefill("s", ids)
    assert len(engine._free) == free - 3
    before = engine.num_computed_tokens
    other = ids[:6] + _ids(5, seed=8)  # diverges inside the second page
    assert _close(engine.prefill("s", other).cpu(), _hf_logits(model, other)[-1])
    assert engine.num_computed_tokens - before == 5
    engine.truncate("s", 3)  # keeps one page; the others go back
    assert engine.cached_token_ids("s") == tuple(other[:3]) and len(engine._free) == free - 1
    again = other[:3] + _ids(6, seed=9)
    engine.prefill("s", again)
    t = _ids(1, seed=10)[0]
    assert _close(engine.decode("s", t).cpu(), _hf_logits(model, again + [t])[-1])
    engine.release("s")
    assert len(engine._free) == free and engine.kv_bytes("s") == 0 and engine.cached_token_ids("s") == ()


def test_a_shared_prefix_is_shared_by_reference_and_written_only_into_own_pages(tied):
    """A session opening with tokens another holds takes that session's whole pages into its block table and
    copies the rows of the last, partly filled one; each side that then writes into a page the other holds gets a
    page of its own first (copy on write), so neither sees the other's tokens; pages go back to the pool when the
    last table holding them lets go."""
    path, model = tied
    engine = _engine(path)
    free = len(engine._free)
    prompt = _ids(18, seed=70)  # 4 whole pages and 2 rows of a fifth
    engine.prefill("a", prompt + [1, 2])
    before = engine.num_computed_tokens
    assert _close(engine.prefill("b", prompt + [3]).cpu(), _hf_logits(model, prompt + [3])[-1])
    assert engine.num_computed_tokens - before == 1 and engine.num_shared_tokens == 18
    a, b = engine._sessions["a"], engine._sessions["b"]
    assert a.pages[:4] == b.pages[:4] and a.pages[4] != b.pages[4]
    assert len(engine._free) == free - 6  # 5 pages of a's and b's own fifth
    assert engine.kv_total_bytes() == 6 * PAGE * engine.info.kv_bytes_per_token
    assert engine.kv_bytes("a") == engine.kv_bytes("b") == 5 * PAGE * engine.info.kv_bytes_per_token
    assert engine.kv_release_bytes("a") == engine.kv_release_bytes("b") == PAGE * engine.info.kv_bytes_per_token
    engine.truncate("a", 2)  # a keeps 2 rows of page 0, which b holds too
    assert len(engine._free) == free - 6 + 1  # a's fifth page: pages 1-3 stay, b holds them
    engine.prefill("a", [*prompt[:2], *[7] * 20])  # a diverges inside page 0: it writes into a copy
    assert not set(engine._sessions["a"].pages) & set(b.pages)
    assert _close(engine.decode("b", 4).cpu(), _hf_logits(model, [*prompt, 3, 4])[-1])
    assert _close(engine.decode("a", 5).cpu(), _hf_logits(model, [*prompt[:2], *[7] * 20, 5])[-1])
    assert engine.share_prefix("c", prompt + [5]) == 18  # from b, the one holder left
    assert engine._sessions["c"].pages[:4] == b.pages[:4]
    assert _close(engine.prefill("c", prompt + [5]).cpu(), _hf_logits(model, prompt + [5])[-1])
    frees, held = engine.kv_release_bytes("b"), engine.kv_total_bytes()
    assert 0 < frees < engine.kv_bytes("b")  # c holds b's first four pages too
    engine.release("b")
    assert held - engine.kv_total_bytes() == frees
    assert _close(engine.decode("c", 6).cpu(), _hf_logits(model, [*prompt, 5, 6])[-1])
    for sid in ("a", "c"):
        engine.release(sid)
    assert len(engine._free) == free and not engine._prefixes and engine.kv_total_bytes() == 0
    assert not any(engine._holders)


def test_a_session_truncated_into_a_shared_page_copies_it_before_it_decodes(tied):
    """The donor goes back into a page its recipient holds (a turn that was not accepted) and decodes there: it
    writes into a copy, and the recipient's rows are what they were."""
    path, model = tied
    engine = _engine(path)
    prompt = _ids(16, seed=74)  # 4 whole pages
    engine.prefill("a", prompt + [1])
    engine.prefill("b", prompt + [2])
    shared = engine._sessions["b"].pages[3]
    assert engine._sessions["a"].pages[3] == shared
    engine.truncate("a", 14)
    assert _close(engine.decode("a", 9).cpu(), _hf_logits(model, [*prompt[:14], 9])[-1])
    assert engine._sessions["a"].pages[3] != shared and engine._holders[shared] == 1
    assert _close(engine.decode("b", 3).cpu(), _hf_logits(model, [*prompt, 2, 3])[-1])


def test_sharing_by_reference_fits_sessions_a_copy_would_not(tied):
    """Four sessions opening with the same 4 pages need 4 + 4 pages by reference: a pool of 9 holds them, where
    copies would need 20."""
    path, model = tied
    per_token = TorchLlamaEngine(path).info.kv_bytes_per_token
    engine = _engine(path, pool=10 * PAGE * per_token)  # 9 usable pages
    opening = _ids(16, seed=75)
    for n in range(4):
        ids = opening + [n + 1]
        assert _close(engine.prefill(f"s{n}", ids).cpu(), _hf_logits(model, ids)[-1])
    assert len(engine._free) == 1 and engine.num_shared_tokens == 3 * 16
    with pytest.raises(KVPoolExhausted, match="2 more pages"):
        engine.prefill("t", _ids(8, seed=76))
    assert engine.cached_token_ids("t") == () and len(engine._free) == 1


def test_random_prefills_truncates_decodes_and_closes_keep_every_session_right(tied):
    """Sessions opening alike (so pages are shared and written around) go through a random mix of prefills that
    diverge at any row, truncates, decodes, batches, releases and kept openings: every logits row matches the
    stateless forward of its session's tokens, and every page is held exactly as often as block tables name it."""
    import random

    path, model = tied
    engine = _engine(path, pool=60 * PAGE * TorchLlamaEngine(path).info.kv_bytes_per_token, kept_prefixes=2)
    rng = random.Random(5)
    openings = [_ids(26, seed=80), _ids(26, seed=80)[:19] + _ids(9, seed=81)]  # past the 16 tokens a donor needs
    logs: dict[str, list[int]] = {}
    for step in range(70):
        sid = f"s{rng.randrange(5)}"
        op = rng.choice(["prefill", "prefill", "prefills", "decode", "batch", "truncate", "close"] if sid in logs
                        else ["prefill", "prefills"])
        if op in ("prefill", "prefills"):
            sids = sorted({sid, *rng.sample([f"s{n}" for n in range(5)], 2)}) if op == "prefills" else [sid]
            seqs = []
            for n, other in enumerate(sids):
                base = logs.get(other) or rng.choice(openings)
                cut = rng.randrange(1 if other in logs else 17, len(base) + 1)
                seqs.append(base[:cut] + _ids(rng.randrange(1, 6), seed=1000 * n + step))
            for other, ids, row in zip(sids, seqs, engine.prefill_batch(sids, seqs)):
                assert _close(row.cpu(), _hf_logits(model, ids)[-1]), (step, op, other)
                logs[other] = ids
        elif op == "decode":
            t = rng.randrange(512)
            assert _close(engine.decode(sid, t).cpu(), _hf_logits(model, logs[sid] + [t])[-1]), (step, op)
            logs[sid].append(t)
        elif op == "batch":
            sids = sorted(logs)
            tokens = [rng.randrange(512) for _ in sids]
            for other, t, row in zip(sids, tokens, engine.decode_batch(sids, tokens)):
                logs[other].append(t)
                assert _close(row.cpu(), _hf_logits(model, logs[other])[-1]), (step, op, other)
        elif op == "truncate":
            n = rng.randrange(1, len(logs[sid]) + 1)
            engine.truncate(sid, n)
            del logs[sid][n:]
        else:
            engine.keep_prefix(sid, rng.randrange(1, len(logs.pop(sid)) + 1))
        tables = [t.pages for t in engine._sessions.values()]
        held = collections.Counter(page for pages in tables for page in pages)
        assert all(engine._holders[page] == held[page] for page in range(engine.num_pages)), step
        assert sorted(engine._free) == [p for p in range(1, engine.num_pages) if not held[p]], step
    assert engine.num_shared_tokens > 0


def test_pages_a_session_gives_up_for_shared_ones_make_room_in_a_full_pool(tied):
    """In a full pool, a session whose new tokens another session holds lets go of its own pages for that one's:
    the pages freed give room for its new ones."""
    path, model = tied
    engine = _engine(path, pool=8 * PAGE * TorchLlamaEngine(path).info.kv_bytes_per_token)  # 7 usable pages
    opening = _ids(16, seed=77)
    engine.prefill("d", opening + [1])  # 5 pages
    engine.prefill("s", _ids(8, seed=78))  # 2 pages: the pool is full
    assert not engine._free
    assert _close(engine.prefill("s", opening + [2]).cpu(), _hf_logits(model, opening + [2])[-1])
    assert engine.num_shared_tokens == 16 and len(engine._free) == 1


def test_kept_prefixes_give_their_pages_to_sessions_that_need_them(tied):
    """A kept opening's pages are referenced by the session that copies it; dropped, it gives back only the pages
    no session holds, and it is dropped when a session needs the room."""
    path, model = tied
    per_token = TorchLlamaEngine(path).info.kv_bytes_per_token
    engine = _engine(path, pool=11 * PAGE * per_token, kept_prefixes=4)  # 10 usable pages
    opening = _ids(16, seed=72)  # 4 pages
    engine.prefill("a", opening + [1])
    assert engine.keep_prefix("a", 16) and len(engine._free) == 6
    assert _close(engine.prefill("b", opening + [2]).cpu(), _hf_logits(model, opening + [2])[-1])
    assert engine.num_shared_tokens == 16 and len(engine._free) == 5  # b's fifth page is its own
    assert engine.drop_kept_prefix() and len(engine._free) == 5  # b holds its pages
    assert _close(engine.decode("b", 3).cpu(), _hf_logits(model, [*opening, 2, 3])[-1])
    engine.release("b")
    engine.prefill("a", opening + [1])
    assert engine.keep_prefix("a", 16) and len(engine._free) == 6
    ids = _ids(28, seed=73)  # 7 pages: only the kept prefix's can give the last one
    assert _close(engine.prefill("c", ids).cpu(), _hf_logits(model, ids)[-1])
    assert engine.kept_prefix_bytes() == 0 and len(engine._free) == 3


def test_reserve_takes_no_pages_ahead(tied):
    path, _ = tied
    engine = _engine(path)
    engine.prefill("s", _ids(9, seed=14))
    pages, free = list(engine._sessions["s"].pages), len(engine._free)
    engine.reserve("s", 40)
    assert engine._sessions["s"].pages == pages and len(engine._free) == free


def test_an_exhausted_pool_is_a_clear_error_and_changes_nothing(tied):
    path, model = tied
    engine = _engine(path, pool=3 * PAGE * TorchLlamaEngine(path).info.kv_bytes_per_token)  # 2 usable pages
    ids = _ids(8, seed=11)
    engine.prefill("a", ids)
    with pytest.raises(KVPoolExhausted, match="KV pool exhausted"):
        engine.decode("a", 1)
    with pytest.raises(KVPoolExhausted, match="0 of 2 free"):
        engine.prefill("b", [1, 2])
    assert engine.cached_token_ids("a") == tuple(ids)
    engine.release("a")
    assert _close(engine.prefill("b", ids[:5]).cpu(), _hf_logits(model, ids[:5])[-1])


def test_prefill_batch_matches_hf_for_each_session_through_the_pages(tied):
    """Sessions prefill as one batch (one from nothing, one over a cached prefix ending mid-page, one fully
    cached): each gets its own logits and keeps its own pages; a session the pool has no room for fails alone."""
    path, model = tied
    per_token = TorchLlamaEngine(path).info.kv_bytes_per_token
    engine = _engine(path, pool=10 * PAGE * per_token)  # 9 usable pages
    seqs = {"new": _ids(6, seed=50), "extend": _ids(15, seed=51), "same": _ids(5, seed=52)}
    engine.prefill("extend", seqs["extend"][:7])
    engine.prefill("same", seqs["same"])
    results = engine.prefill_batch(list(seqs), list(seqs.values()))
    for (sid, ids), logits in zip(seqs.items(), results):
        assert _close(logits.cpu(), _hf_logits(model, ids)[-1]), sid
        assert engine.cached_token_ids(sid) == tuple(ids)
    assert _close(engine.decode("extend", 9).cpu(), _hf_logits(model, [*seqs["extend"], 9])[-1])
    # 2 + 4 + 2 pages in use, 1 free: "more" (3 pages) cannot have its pages; "new" takes the free one.
    more = _ids(12, seed=53)
    results = engine.prefill_batch(["more", "new"], [more, [*seqs["new"], 1, 2, 3]])
    assert isinstance(results[0], KVPoolExhausted) and not engine.cached_token_ids("more")
    assert _close(results[1].cpu(), _hf_logits(model, [*seqs["new"], 1, 2, 3])[-1])


def test_a_prefill_whose_pages_were_freed_meanwhile_is_refused(tied):
    path, _ = tied
    engine = _engine(path)
    engine.prefill("s", _ids(9, seed=12))
    steps = engine.prefill_steps("s", _ids(9, seed=12) + _ids(4, seed=13))
    next(steps)
    engine.truncate("s", 2)
    with pytest.raises(RuntimeError, match="changed while its prefill"):
        for _ in steps:
            pass


def test_the_engine_starts_where_triton_has_no_knobs(tied, monkeypatch):
    # OpenAI Triton 3.0-3.2 (NVIDIA's containers) has no triton.knobs: the engine read it and raised AttributeError.
    import triton

    if CUDA:
        pytest.skip("checks the interpreted kernel on CPU tensors")
    path, model = tied
    monkeypatch.delattr(triton, "knobs", raising=False)  # absent already before 3.4
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = _ids(5, seed=7)
    assert _close(_engine(path).prefill("s", ids).cpu(), _hf_logits(model, ids)[-1])


def test_bad_arguments_are_named(tied):
    path, _ = tied
    with pytest.raises(ValueError, match="page_tokens must be a power of two"):
        PagedTorchLlamaEngine(path, device=DEVICE, page_tokens=6)
    with pytest.raises(ValueError, match="fewer than 2 pages"):
        PagedTorchLlamaEngine(path, device=DEVICE, kv_pool_bytes=1)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):  # the kernels run on CUDA, or interpreted on CPU
        PagedTorchLlamaEngine(path, device="cpu" if CUDA else "cuda")
    with pytest.raises(ValueError, match=r"max_batch must be in \[1, 1024\], got 0"):
        _engine(path, max_batch=0)
    engine = _engine(path)
    with pytest.raises(ValueError, match="no KV"):
        engine.decode("nobody", 1)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_is_token_identical_to_a_stateless_prefill(tied, dtype):
    """fp32: every greedy token equals the stateless forward's and the logits match transformers'.
    bf16: the two forwards round differently (the decode attention accumulates in fp32, SDPA in bf16), so
    the logits must agree within bf16 rounding, and the token must be the same wherever the stateless
    forward's top-2 gap is wider than that."""
    path, model = tied
    engine = PagedTorchLlamaEngine(path, device="cuda", dtype=dtype, page_tokens=16, kv_pool_bytes=64 << 20)
    stateless = TorchLlamaEngine(path, device="cuda", dtype=dtype)
    logs = {"a": _ids(20, seed=14), "b": _ids(45, seed=15)}
    last = {sid: engine.prefill(sid, log) for sid, log in logs.items()}
    decided = 0
    for _ in range(24):
        for sid, log in logs.items():
            token = int(torch.argmax(last[sid]))
            log.append(token)
            last[sid] = engine.decode(sid, token)
            assert last[sid].device.type == "cuda"
            ref = stateless.prefill(f"x{sid}{len(log)}", log)
            if dtype == "float32":
                assert int(torch.argmax(last[sid])) == int(torch.argmax(ref))
                assert _close(last[sid].cpu(), _hf_logits(model, log)[-1])
                continue
            tol = 0.02 * float(ref.abs().max())  # a few bf16 ulps at the logits' scale
            assert float((last[sid] - ref).abs().max()) <= tol
            top2 = torch.topk(ref, 2).values
            if float(top2[0] - top2[1]) > 2 * tol:
                decided += 1
                assert int(torch.argmax(last[sid])) == int(torch.argmax(ref))
    assert list(engine._graphs) == [1]
    assert dtype == "float32" or decided >= 10  # the token check was not vacuous


@needs_cuda
@pytest.mark.gpu
def test_cuda_graph_decode_batches_match_the_eager_step_for_each_session(tied):
    """Batches of 1, 2 and 3 sessions through graphs of at most 2 rows (3 is taken as 2 + 1, back to back, so the
    second step's inputs must not overwrite the first's before they are copied) give each session the logits
    of the eager step."""
    path, _ = tied
    kw = dict(device="cuda", page_tokens=16, kv_pool_bytes=64 << 20, max_batch=2)
    graphed, eager = PagedTorchLlamaEngine(path, **kw), PagedTorchLlamaEngine(path, cuda_graph=False, **kw)
    logs = {sid: _ids(5 + 11 * i, seed=50 + i) for i, sid in enumerate("abc")}
    for sid, log in logs.items():
        graphed.prefill(sid, log)
        log.append(int(eager.prefill(sid, log).argmax()))
    for step in range(18):
        live = list(logs)[: 1 + step % 3]
        tokens = [logs[sid][-1] for sid in live]
        got, want = graphed.decode_batch(live, tokens), eager.decode_batch(live, tokens)
        for sid, g, w in zip(live, got, want):
            assert g.device.type == "cuda" and _close(g.cpu(), w.cpu()), (step, sid)
            logs[sid].append(int(w.argmax()))
    assert sorted(graphed._graphs) == [1, 2] and not eager._graphs
    assert all(list(graphed.cached_token_ids(sid)) == log[:-1] for sid, log in logs.items())


def test_gpu_bench_times_each_decode_batch_size_and_leaves_the_pool_as_it_was(tied):
    import gpu_bench

    path, _ = tied
    engine = _engine(path, max_batch=4)
    free, computed = len(engine._free), engine.num_computed_tokens
    prefix = _ids(6, seed=60)
    res = gpu_bench.bench_decode_batches(engine, prefix, (1, 2, 3), steps=2)
    assert list(res) == ["1", "2", "3"] and res["1"]["step_over_one"] == 1.0
    for n, r in res.items():
        assert r["tokens_per_s"] == pytest.approx(int(n) / (r["step_median_ms"] / 1e3))
        assert r["step_p99_ms"] >= r["step_median_ms"] > 0
    assert engine.num_computed_tokens - computed == 3 * len(prefix) + (1 + 2 + 3) * (2 + 3)  # 3 prefills, every step
    assert len(engine._free) == free and not engine._sessions


def test_gpu_bench_times_a_prefill_batch_against_one_after_another_and_leaves_the_pool_as_it_was(tied):
    import gpu_bench

    path, _ = tied
    engine = _engine(path)
    free, computed = len(engine._free), engine.num_computed_tokens
    prefix, delta = _ids(6, seed=61), _ids(5, seed=62)
    res = gpu_bench.bench_prefill_batch(engine, prefix, delta, sessions=3, runs=2)
    assert res["sessions"] == 3 and res["delta"] == 5
    for way in ("batched", "serial"):
        assert res[f"{way}_p99_ms"] >= res[f"{way}_median_ms"] > 0
    assert res["serial_over_batched"] == pytest.approx(res["serial_median_ms"] / res["batched_median_ms"])
    assert engine.num_computed_tokens - computed == 3 * 6 + 2 * (2 + 2) * 3 * 5  # prefixes, then every prefill
    assert len(engine._free) == free and not engine._sessions
    row = gpu_bench.table({"gpu": "test", "torch": "-", "triton": "-", "read_bandwidth_gbps": 1.0, "engines": [{
        "arch": "tiny", "weight_bytes": 1e9, "context": 6, "delta": 5, "decode_bound_ms": 1.0,
        **{f"decode_{w}_{k}": 1.0 for w in ("paged+graph", "eager") for k in ("median_ms", "p99_ms", "over_bound")},
        **{f"{p}_first_token_{k}": 1.0 for p in ("prefix", "gated") for k in ("median_ms", "p99_ms")},
        "prefix_over_gated": 1.0, "prefill_tok_s": {}, "prefill_batch": res}]})
    assert f"| prefill of 3 sessions x 5 tokens, one after another | {res['serial_median_ms']:.3f} ms (" in row
