"""TorchLlamaEngine against transformers' LlamaForCausalLM on a tiny random checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from prepos.engines.llama_weights import cpu_chunks
from prepos.engines.torch_llama import TorchLlamaEngine

ATOL = 1e-4
BLOCK = 16


def _hf_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits ``[seq, vocab]`` of a full no-cache forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= ATOL


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_prefill_matches_hf(which, request):
    path, model = request.getfixturevalue(which)
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    ids = _ids(37, seed=1)
    logits = engine.prefill("s", ids)
    assert logits.shape == (512,) and logits.dtype == torch.float32
    assert _close(logits, _hf_logits(model, ids)[-1])
    assert engine.num_computed_tokens == 37


def test_info(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path)
    info = engine.info
    assert info.name == "torch" and info.vocab_size == 512 and info.max_context == 256
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers * k,v * kv_heads * head_dim * fp32
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64  # qkv, o, gate+up, down
    assert info.weight_bytes == 4 * (2 * per_layer + 64 + 512 * 64)  # + final norm, tied embedding once
    assert info.device == "cpu"


def test_prefix_reuse_computes_only_suffix(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b = _ids(20, seed=2), _ids(9, seed=3)
    engine.prefill("s", a)
    before = engine.num_computed_tokens
    logits = engine.prefill("s", a + b)
    assert engine.num_computed_tokens - before == len(b)
    assert _close(logits, engine.prefill("fresh", a + b))
    assert _close(logits, _hf_logits(model, a + b)[-1])
    assert list(engine.cached_token_ids("s")) == a + b


def test_diverging_sequences(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b, c = _ids(18, seed=4), _ids(30, seed=5), _ids(7, seed=6)
    assert b[0] != c[0]
    engine.prefill("s", a + b)
    before = engine.num_computed_tokens
    logits = engine.prefill("s", a + c)
    assert engine.num_computed_tokens - before == len(c)
    assert list(engine.cached_token_ids("s")) == a + c
    assert _close(logits, engine.prefill("fresh", a + c))
    assert _close(logits, _hf_logits(model, a + c)[-1])


def test_fully_cached_prefill_recomputes_last_token(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    ids = _ids(25, seed=7)
    first = engine.prefill("s", ids).clone()
    before = engine.num_computed_tokens
    again = engine.prefill("s", ids)
    assert engine.num_computed_tokens - before == 1
    assert _close(first, again)
    # A strict prefix of the cache is also "fully cached": KV shrinks to it.
    shorter = engine.prefill("s", ids[:10])
    assert list(engine.cached_token_ids("s")) == ids[:10]
    assert _close(shorter, engine.prefill("fresh", ids[:10]))


def test_greedy_decode_matches_hf(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    prompt = _ids(12, seed=8)
    # Reference: argmax loop over full no-cache forwards.
    ref = list(prompt)
    for _ in range(20):
        ref.append(int(_hf_logits(model, ref)[-1].argmax()))
    out = list(prompt)
    logits = engine.prefill("s", prompt)
    for step in range(20):
        token = int(logits.argmax())
        out.append(token)
        if step < 19:
            logits = engine.decode("s", token)
    assert out == ref
    assert list(engine.cached_token_ids("s")) == out[:-1]
    # Decode logits themselves match, across the KV growth at BLOCK tokens.
    hf = _hf_logits(model, out)
    assert _close(logits, hf[-2])


def test_decode_logits_match_hf_each_step(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    ids = _ids(40, seed=9)
    hf = _hf_logits(model, ids)
    engine.prefill("s", ids[:5])
    for i in range(5, 40):
        assert _close(engine.decode("s", ids[i]), hf[i]), i


@pytest.mark.parametrize("which", ["tied", "untied"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_decode_batch_matches_hf_for_each_session(which, kernels, request):
    """Sessions of different lengths decode together (KV growing past a block on the way) and each gets the
    logits a full forward of its own sequence gives."""
    path, model = request.getfixturevalue(which)
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=kernels)
    seqs = {"a": _ids(5, seed=20), "b": _ids(14, seed=21), "c": _ids(31, seed=22)}
    for sid, ids in seqs.items():
        seqs[sid].append(int(engine.prefill(sid, ids).argmax()))
    computed = engine.num_computed_tokens
    for _ in range(4):
        results = engine.decode_batch(list(seqs), [ids[-1] for ids in seqs.values()])
        for (sid, ids), logits in zip(seqs.items(), results):
            assert _close(logits, _hf_logits(model, ids)[-1]), sid
            assert list(engine.cached_token_ids(sid)) == ids
            ids.append(int(logits.argmax()))
    assert engine.num_computed_tokens == computed + 4 * 3


def test_decode_batch_refuses_an_impossible_step_alone(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b = _ids(6, seed=23), _ids(9, seed=24)
    engine.prefill("a", a)
    engine.prefill("b", b)
    results = engine.decode_batch(["a", "nosuch", "b"], [7, 8, 512])  # 512: past the vocabulary
    assert isinstance(results[1], ValueError) and "'nosuch' has no KV" in str(results[1])
    assert isinstance(results[2], ValueError) and "token id 512" in str(results[2])
    assert _close(results[0], _hf_logits(model, [*a, 7])[-1])
    assert list(engine.cached_token_ids("a")) == [*a, 7] and list(engine.cached_token_ids("b")) == b
    for sids, toks, problem in ((["a", "a"], [1, 2], "appears twice"), (["a", "b"], [1], "2 sessions but 1 tokens")):
        with pytest.raises(ValueError, match=problem):
            engine.decode_batch(sids, toks)
    assert list(engine.cached_token_ids("a")) == [*a, 7] and list(engine.cached_token_ids("b")) == b


@pytest.mark.parametrize("which", ["tied", "untied"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_prefill_batch_matches_hf_for_each_session(which, kernels, request):
    """Sessions prefill together from different starting points (no KV, a cached prefix, a diverging one, the
    whole sequence cached, KV growing past a block): each gets the logits a full forward of its own sequence
    gives, holds exactly its tokens, and only the new tokens are computed."""
    path, model = request.getfixturevalue(which)
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=kernels)
    seqs = {"new": _ids(7, seed=40), "extend": _ids(29, seed=41), "diverge": _ids(20, seed=42), "same": _ids(9, seed=43)}
    engine.prefill("extend", seqs["extend"][:12])
    engine.prefill("diverge", [*seqs["diverge"][:6], *_ids(10, seed=44)])
    engine.prefill("same", seqs["same"])
    computed = engine.num_computed_tokens
    results = engine.prefill_batch(list(seqs), list(seqs.values()))
    for (sid, ids), logits in zip(seqs.items(), results):
        assert _close(logits, _hf_logits(model, ids)[-1]), sid
        assert list(engine.cached_token_ids(sid)) == ids, sid
    assert engine.num_computed_tokens == computed + 7 + (29 - 12) + (20 - 6) + 1  # "same" recomputes its last
    ids = seqs["extend"]
    logits = engine.decode("extend", 3)  # the batch's KV is the session's own
    assert _close(logits, _hf_logits(model, [*ids, 3])[-1])


def test_prefill_batch_refuses_an_impossible_prefill_alone(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b = _ids(6, seed=45), _ids(9, seed=46)
    engine.prefill("b", b)
    results = engine.prefill_batch(["a", "b", "c", "d"], [a, [*b, 512], [], _ids(300, seed=47)])
    assert isinstance(results[1], ValueError) and "token ids must lie in [0, 512)" in str(results[1])
    assert isinstance(results[2], ValueError)
    assert isinstance(results[3], ValueError) and "exceed max_context 256" in str(results[3])
    assert _close(results[0], _hf_logits(model, a)[-1])
    assert list(engine.cached_token_ids("a")) == a and list(engine.cached_token_ids("b")) == b
    assert not engine.cached_token_ids("c") and not engine.cached_token_ids("d")
    for sids, seqs, problem in ((["a", "a"], [a, a], "appears twice"), (["a", "b"], [a], "2 sessions but 1 token")):
        with pytest.raises(ValueError, match=problem):
            engine.prefill_batch(sids, seqs)
    assert list(engine.cached_token_ids("a")) == a and list(engine.cached_token_ids("b")) == b


def test_hf_generate_agrees(tied):
    path, model = tied
    engine = TorchLlamaEngine(path)
    prompt = _ids(8, seed=10)
    # An explicit attention mask: otherwise generate treats prompt tokens equal to pad_token_id as padding.
    gen = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False, max_new_tokens=20, min_new_tokens=20, eos_token_id=None, pad_token_id=0,
    )[0].tolist()
    out = list(prompt)
    logits = engine.prefill("s", prompt)
    for _ in range(20):
        out.append(int(logits.argmax()))
        logits = engine.decode("s", out[-1])
    assert out == gen


# Outputs of the test model's q/k/v, o, gate/up, down and lm_head: 128, 64, 256, 64 and 512 wide.
@pytest.mark.parametrize("threads, blocks", [
    (1, [1, 1, 1, 1, 1]),
    (2, [4, 2, 8, 2, 16]),  # 32-column blocks
    (3, [1, 1, 1, 1, 1]),  # 3 divides none of the widths
    (4, [4, 4, 8, 4, 16]),  # 64 / 32 = 2 blocks would not split over 4 threads: one per thread
])
def test_weight_chunking_and_generic_norm_path(tied, threads, blocks):
    """Without the CPU kernel, packed matrices follow cpu_chunks, and every chunking gives transformers' logits."""
    path, model = tied
    saved = torch.get_num_threads()
    try:
        engine = TorchLlamaEngine(path, num_threads=threads, kv_block_tokens=BLOCK, cpu_kernels=False)
    finally:
        torch.set_num_threads(saved)
    w = engine.products
    assert [m.shape[0] for m in (w.wqkv[0], w.wo[0], w.wgu[0], w.wdown[0], w.lm_head)] == blocks
    ids = _ids(24, seed=13)
    hf = _hf_logits(model, ids)
    assert _close(engine.prefill("s", ids[:20]), hf[19])
    assert _close(engine.decode("s", ids[20]), hf[20])
    engine.products.cpu = False  # the device-agnostic norm used off CPU
    assert _close(engine.decode("s", ids[21]), hf[21])


@pytest.mark.parametrize("out, threads, chunks", [
    (960, 2, 30), (576, 2, 18),  # SmolLM2-135M q/k/v and o/down: 32-column blocks
    (3072, 2, 2), (49152, 2, 2),  # its gate/up and lm_head: 1536+ columns per thread
    (2048, 2, 2), (3072, 4, 96),  # 1024 columns per thread are wide, 768 are not
    (96, 2, 2),  # 3 blocks of 32 would not split over 2 threads: one per thread
    (100, 2, 2), (101, 2, 1), (960, 1, 1),
])
def test_cpu_chunks(out, threads, chunks):
    assert cpu_chunks(out, threads) == chunks


def _drain(steps):
    """Run a prefill_steps generator to the end: (number of yields, returned logits)."""
    n = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return n, done.value
        n += 1


def test_prefill_steps_yield_per_layer_and_interleave(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b = _ids(20, seed=14), _ids(10, seed=15)
    engine.prefill("s", a)
    engine.prefill("other", b)
    steps = engine.prefill_steps("s", a + b)
    next(steps)
    # Between steps the engine serves other sessions.
    other = engine.decode("other", 7)
    assert _close(other, _hf_logits(model, b + [7])[-1])
    n, logits = _drain(steps)
    assert n == 1  # 2 layers: one yield after each, the first taken above
    assert _close(logits, _hf_logits(model, a + b)[-1])
    assert list(engine.cached_token_ids("s")) == a + b


def test_prefill_steps_closed_early_keeps_a_prefix(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    a, b, c = _ids(12, seed=16), _ids(9, seed=17), _ids(5, seed=18)
    engine.prefill("s", a + b)
    steps = engine.prefill_steps("s", a + c)
    next(steps)
    steps.close()
    cached = list(engine.cached_token_ids("s"))
    assert cached == (a + b)[: len(cached)]
    assert _close(engine.prefill("s", a + c), _hf_logits(model, a + c)[-1])


def test_prefill_steps_session_released_or_changed_meanwhile(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    ids = _ids(15, seed=19)
    steps = engine.prefill_steps("s", ids)
    next(steps)
    engine.release("s")
    _, logits = _drain(steps)
    assert _close(logits, _hf_logits(model, ids)[-1])
    assert engine.kv_bytes("s") == 0 and tuple(engine.cached_token_ids("s")) == ()
    engine.prefill("s", ids[:3])
    steps = engine.prefill_steps("s", ids)
    next(steps)
    engine.truncate("s", 1)
    with pytest.raises(RuntimeError, match="changed"):
        _drain(steps)


def test_a_prefix_another_session_holds_is_copied_not_computed(tied):
    """Sessions that open with the same tokens (a system prompt): the second copies the first one's KV for the
    shared part and computes only its own tokens; both then decode as a full forward of their own log does."""
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    prompt, a, b = _ids(40, seed=60), [1, 2, 3], [4, 5, 6, 7]
    engine.prefill("a", prompt + a)
    before = engine.num_computed_tokens
    logits = engine.prefill("b", prompt + b)
    assert engine.num_computed_tokens - before == len(b) and engine.num_shared_tokens == len(prompt)
    assert _close(logits, _hf_logits(model, prompt + b)[-1])
    assert list(engine.cached_token_ids("b")) == prompt + b
    for sid, log in (("a", prompt + a), ("b", prompt + b)):
        assert _close(engine.decode(sid, 9), _hf_logits(model, [*log, 9])[-1]), sid
    # a whole sequence another session holds: only its last token is computed, for the logits
    before = engine.num_computed_tokens
    assert _close(engine.prefill("c", prompt + a), _hf_logits(model, prompt + a)[-1])
    assert engine.num_computed_tokens - before == 1


def test_prefix_sharing_takes_the_longest_holder_and_skips_what_is_gone_short_or_off(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    prompt = _ids(60, seed=61)
    engine.prefill("short", prompt[:30])
    engine.prefill("long", prompt[:50])  # copies short's 30 tokens
    engine.prefill("other", _ids(60, seed=62))
    assert engine.num_shared_tokens == 30 and engine.num_computed_tokens == 30 + 20 + 60
    assert engine.share_prefix("s", prompt) == 50  # the longest holder, not the most recent one
    assert engine.num_shared_tokens == 30 + 50 and engine.num_computed_tokens == 30 + 20 + 60
    assert _close(engine.prefill("s", prompt), _hf_logits(model, prompt)[-1])
    assert engine.num_computed_tokens == 30 + 20 + 60 + 10
    # what a holder no longer has is not copied: truncated below the listing tokens, released
    engine.truncate("long", 10)
    engine.release("s")
    assert engine.share_prefix("t", prompt) == 30
    engine.release("short")
    engine.release("t")
    assert engine.share_prefix("u", prompt) == 0 and not engine.cached_token_ids("u")
    # fewer shared tokens than a session is listed by are computed; so is everything with sharing off
    engine.prefill("v", prompt[:15] + [7] * 20)
    before = engine.num_computed_tokens
    engine.prefill("w", prompt[:15] + [8] * 20)
    assert engine.num_computed_tokens - before == 35
    off = TorchLlamaEngine(path, kv_block_tokens=BLOCK, share_prefixes=False)
    off.prefill("a", prompt)
    assert off.share_prefix("b", prompt) == 0
    off.prefill("b", prompt)
    assert off.num_computed_tokens == 120 and off.num_shared_tokens == 0
    for sid in ("long", "other", "u", "v", "w"):
        engine.release(sid)
    assert not engine._prefixes  # releases take their listings with them


def test_the_longest_holder_is_found_among_many_sessions_with_the_same_start(tied):
    """Every session opens alike (one instruction, then a different tool list): the one holding the asked list is
    found however many were listed after it."""
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    start, tools = _ids(30, seed=80), _ids(150, seed=81)
    engine.prefill("holder", start + tools)
    for i in range(3 * 8):
        engine.prefill(f"other{i}", start + _ids(150, seed=100 + i))
    assert engine.share_prefix("s", start + tools + [1]) == 180
    assert _close(engine.prefill("s", start + tools + [1]), _hf_logits(model, start + tools + [1])[-1])
    assert engine.share_prefix("t", start + tools[:100] + [2]) == 130  # part of it, up to where it differs


def test_share_prefix_keeps_what_the_session_holds_when_no_one_holds_more(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    prompt = _ids(40, seed=63)
    engine.prefill("a", prompt[:20])
    engine.prefill("s", prompt + [5, 6])
    assert engine.share_prefix("s", prompt + [7]) == 40  # its own prefix; what follows it is kept too
    assert list(engine.cached_token_ids("s")) == prompt + [5, 6]
    # ids a prefill refuses share nothing and change nothing (the prefill names the problem)
    engine.prefill("b", prompt + [8])
    assert engine.share_prefix("s", prompt + [8, 10_000]) == 40
    assert engine.share_prefix("s", []) == 0
    assert list(engine.cached_token_ids("s")) == prompt + [5, 6]


def test_share_prefix_makes_room_for_all_the_tokens_so_a_chunked_prefill_grows_the_kv_once(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    ids = _ids(9 * BLOCK, seed=66)
    assert engine.share_prefix("s", ids) == 0  # nobody holds any of it: nothing shared, room made
    kv = engine._sessions["s"].kv
    assert engine.kv_bytes("s") == 9 * BLOCK * engine.info.kv_bytes_per_token
    for end in range(BLOCK, len(ids) + 1, BLOCK):
        logits = engine.prefill("s", ids[:end])
        assert engine._sessions["s"].kv is kv
    assert _close(logits, _hf_logits(model, ids)[-1])


def test_prefill_batch_copies_shared_prefixes(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    prompt = _ids(32, seed=64)
    engine.prefill("donor", prompt)
    seqs = {"x": prompt + [1, 2], "y": prompt[:20] + [3, 4, 5], "z": _ids(6, seed=65)}
    before = engine.num_computed_tokens
    for (sid, ids), logits in zip(seqs.items(), engine.prefill_batch(list(seqs), list(seqs.values()))):
        assert _close(logits, _hf_logits(model, ids)[-1]), sid
        assert list(engine.cached_token_ids(sid)) == ids
    assert engine.num_computed_tokens - before == 2 + 3 + 6 and engine.num_shared_tokens == 32 + 20


def test_a_closed_sessions_opening_is_kept_for_later_sessions_to_copy(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, kept_prefixes=4)
    per_token = engine.info.kv_bytes_per_token
    opening = _ids(40, seed=66)
    engine.prefill("a", opening + [1, 2, 3])
    assert engine.keep_prefix("a", len(opening))
    assert engine.cached_token_ids("a") == () and engine.kv_bytes("a") == 0
    assert engine.kept_prefix_bytes() == 3 * BLOCK * per_token  # its first 40 tokens' blocks, not the rest
    before = engine.num_computed_tokens
    assert _close(engine.prefill("b", opening + [4, 5]), _hf_logits(model, opening + [4, 5])[-1])
    assert engine.num_computed_tokens - before == 2 and engine.num_shared_tokens == 40
    # b holds all of it now: closing b keeps nothing more, it only releases
    assert not engine.keep_prefix("b", len(opening)) and engine.kv_bytes("b") == 0
    assert engine.kept_prefix_bytes() == 3 * BLOCK * per_token
    # openings too short to be listed, and ones past what the session holds, are released
    engine.prefill("c", opening[:10] + [6])
    assert not engine.keep_prefix("c", 11) and engine.kv_bytes("c") == 0
    # an opening past what the session holds (its last answer token never went through the model): what it holds
    engine.prefill("d", _ids(20, seed=67))
    assert engine.keep_prefix("d", 21) and engine.kv_bytes("d") == 0
    assert engine.share_prefix("e", _ids(20, seed=67) + [1]) == 20
    engine.release("e")
    assert engine.drop_kept_prefix() and engine.drop_kept_prefix() and not engine.drop_kept_prefix()  # a's, d's
    assert engine.kept_prefix_bytes() == 0 and not engine._prefixes
    assert not engine.keep_prefix("nobody", 20)
    off = TorchLlamaEngine(path, kv_block_tokens=BLOCK)  # kept_prefixes 0
    off.prefill("a", opening)
    assert not off.keep_prefix("a", len(opening)) and off.kv_bytes("a") == 0 and off.kept_prefix_bytes() == 0


def test_kept_prefixes_are_bounded_least_recently_copied_first_and_a_longer_one_replaces_its_start(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, kept_prefixes=2)
    x, y, z = (_ids(20, seed=seed) for seed in (68, 69, 70))

    def keep(sid, ids):
        engine.prefill(sid, ids)
        assert engine.keep_prefix(sid, len(ids))

    keep("x", x)
    keep("y", y)
    engine.prefill("reader", x + [1])  # copies x: y is now the least recently copied
    engine.release("reader")
    keep("z", z)  # a third: y goes
    assert engine.share_prefix("p", y + [1]) == 0
    assert engine.share_prefix("q", x + [1]) == 20 and engine.share_prefix("r", z + [1]) == 20
    for sid in "pqr":
        engine.release(sid)
    keep("z2", z + _ids(12, seed=71))  # extends z: z's kept prefix is dropped, x stays
    assert len(engine._kept) == 2 and engine.kept_prefix_bytes() == (2 + 2) * BLOCK * engine.info.kv_bytes_per_token
    assert engine.share_prefix("s", z + [1]) == 20 and engine.share_prefix("t", x + [1]) == 20
    with pytest.raises(ValueError, match="kept_prefixes"):
        TorchLlamaEngine(path, kept_prefixes=-1)


def test_kv_bookkeeping(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    per_token = engine.info.kv_bytes_per_token
    assert engine.kv_bytes("s") == 0
    assert tuple(engine.cached_token_ids("s")) == ()
    ids = _ids(BLOCK + 3, seed=11)
    engine.prefill("s", ids[:BLOCK])
    assert engine.kv_bytes("s") == BLOCK * per_token
    engine.decode("s", ids[BLOCK])
    assert engine.kv_bytes("s") == 2 * BLOCK * per_token
    cached = engine.cached_token_ids("s")
    assert list(cached) == ids[: BLOCK + 1]
    if isinstance(cached, list):
        cached.append(0)
        assert list(engine.cached_token_ids("s")) == ids[: BLOCK + 1]
    engine.truncate("s", 5)
    assert list(engine.cached_token_ids("s")) == ids[:5]
    assert engine.kv_bytes("s") == BLOCK * per_token
    engine.truncate("s", 100)  # past the end: keeps everything
    assert list(engine.cached_token_ids("s")) == ids[:5]
    with pytest.raises(ValueError):
        engine.truncate("s", -1)
    # Decoding after a truncate continues from the kept prefix.
    fresh = engine.prefill("fresh", ids[:6])
    assert _close(engine.decode("s", ids[5]), fresh)
    # Truncating to nothing frees the KV; decoding then equals prefilling the one token.
    engine.truncate("s", 0)
    assert engine.kv_bytes("s") == 0 and tuple(engine.cached_token_ids("s")) == ()
    assert _close(engine.decode("s", ids[0]), engine.prefill("fresh", ids[:1]))
    assert engine.kv_bytes("s") == BLOCK * per_token
    engine.release("s")
    assert engine.kv_bytes("s") == 0 and tuple(engine.cached_token_ids("s")) == ()
    engine.release("s")  # no-op
    engine.truncate("nobody", 3)  # no-op


def test_kv_grows_by_a_block_while_short_and_by_an_eighth_once_long(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=False)
    per_token = engine.info.kv_bytes_per_token
    ids = _ids(12 * BLOCK + 1, seed=23)
    engine.prefill("s", ids[:3])
    assert engine.kv_bytes("s") == BLOCK * per_token  # one block for a short session
    capacities = {BLOCK}
    logits = None
    for pos in range(3, 10 * BLOCK):
        logits = engine.decode("s", ids[pos])
        capacities.add(engine.kv_bytes("s") // per_token)
    # past 8 blocks each growth adds an eighth of the capacity, rounded up to blocks: 8 -> 9 -> 11 blocks
    assert sorted(capacities) == [b * BLOCK for b in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11)]
    assert _close(logits, _hf_logits(model, ids[:10 * BLOCK])[-1])  # the copies kept every token's KV
    engine.prefill("t", ids[:9 * BLOCK + 1])  # a prefill allocates what it needs, rounded up to a block
    assert engine.kv_bytes("t") == 10 * BLOCK * per_token


def test_reserve_grows_the_kv_ahead_so_the_next_turn_does_not_copy_it(tied):
    """Room made for a turn ahead: the turn's prefill writes into the same KV (no copy), with the same logits;
    room is never made past max_context, for a session without KV, or smaller than what the KV holds."""
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=False)
    per_token = engine.info.kv_bytes_per_token
    ids = _ids(9 * BLOCK, seed=24)
    engine.prefill("s", ids)
    assert engine.kv_bytes("s") == 9 * BLOCK * per_token  # full: a turn would grow it by a copy
    engine.reserve("s", 9 * BLOCK + 9 * BLOCK // 16)
    kv = engine._sessions["s"].kv
    assert engine.kv_bytes("s") == 11 * BLOCK * per_token  # the growth step: an eighth, rounded up to blocks
    turn = ids + _ids(7, seed=25)
    assert _close(engine.prefill("s", turn), _hf_logits(model, turn)[-1])
    assert engine._sessions["s"].kv is kv
    engine.reserve("s", 3)
    assert engine.kv_bytes("s") == 11 * BLOCK * per_token
    engine.reserve("s", 10**6)
    assert engine.kv_bytes("s") == engine.info.max_context * per_token
    engine.reserve("nobody", 100)
    assert engine.kv_bytes("nobody") == 0 and engine.cached_token_ids("nobody") == ()


def test_reserve_steps_copy_a_layer_at_a_time_and_drop_the_copy_when_the_session_changes_meanwhile(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=False)
    ids = _ids(2 * BLOCK, seed=26)
    engine.prefill("s", ids)
    kv = engine._sessions["s"].kv
    steps = engine.reserve_steps("s", 3 * BLOCK)
    assert sum(1 for _ in steps) == engine.n_layers and engine._sessions["s"].kv is not kv
    assert engine.kv_bytes("s") == 3 * BLOCK * engine.info.kv_bytes_per_token
    assert _close(engine.decode("s", 7), _hf_logits(model, [*ids, 7])[-1])  # every layer's rows came along
    kv = engine._sessions["s"].kv
    steps = engine.reserve_steps("s", 5 * BLOCK)
    next(steps)
    engine.decode("s", 8)  # the session moved on: the half-made copy is dropped, its KV stays
    assert sum(1 for _ in steps) == engine.n_layers - 1 and engine._sessions["s"].kv is kv
    assert _close(engine.decode("s", 9), _hf_logits(model, [*ids, 7, 8, 9])[-1])


def test_input_validation(tied):
    path, _ = tied
    engine = TorchLlamaEngine(path, kv_block_tokens=BLOCK)
    with pytest.raises(ValueError, match="empty"):
        engine.prefill("s", [])
    with pytest.raises(ValueError, match="max_context"):
        engine.prefill("s", [1] * 257)
    with pytest.raises(ValueError):
        engine.prefill("s", [1, 512])
    with pytest.raises(ValueError):
        engine.prefill("s", [-1, 3])
    with pytest.raises(ValueError):
        engine.decode("s", 3)  # no KV yet
    engine.prefill("s", [1] * 256)
    with pytest.raises(ValueError, match="max_context"):
        engine.decode("s", 3)
    engine.truncate("s", 2)
    with pytest.raises(ValueError):
        engine.decode("s", 512)
    assert list(engine.cached_token_ids("s")) == [1, 1]


def test_refuses_rope_scaling(tmp_path, tied):
    path, _ = tied
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(path, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope"):
        TorchLlamaEngine(str(tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_prefill_and_decode_match_hf_on_cuda(tied):
    path, model = tied
    engine = TorchLlamaEngine(path, device="cuda", kv_block_tokens=BLOCK)
    ids = _ids(30, seed=12)
    hf = _hf_logits(model, ids)
    logits = engine.prefill("s", ids[:20])
    assert logits.device.type == "cuda"
    assert _close(logits.cpu(), hf[19])
    for i in range(20, 30):
        assert _close(engine.decode("s", ids[i]).cpu(), hf[i]), i
