"""The torch engines under random mixes of its contract's calls, as the engine loop makes them, against transformers.

Sessions that open alike (so that prefixes are copied between them and kept openings are used) go through
prefills, batch prefills, decodes, batch decodes, truncates, releases, kept openings, ``share_prefix`` followed by a
prefill in chunks, and room made ahead; a pre-positioning's ``prefill_steps`` and a ``reserve_steps`` copy stay in
flight across other calls, and a call on their own session closes them first, as the engine loop does. Every
logits row is checked against a stateless forward of the session's tokens; after every call, each session's
cached tokens against the test's model of them, and its donor listings against them (never listed for more).
"""

from __future__ import annotations

import os
import random

import pytest

from prepos.engines.base import common_prefix_length
from prepos.engines.prefix_index import prefix_hashes
from prepos.engines.torch_llama import TorchLlamaEngine
from prepos.engines.torch_paged import PagedTorchLlamaEngine

from engines.test_torch_llama import BLOCK, _close, _hf_logits, _ids

SESSIONS = [f"s{n}" for n in range(5)]
MAX_TOKENS = 200  # the tiny checkpoint's context is 256


class Mix:
    def __init__(self, engine: TorchLlamaEngine, model, seed: int):
        self.engine, self.model, self.rng = engine, model, random.Random(seed)
        opening = _ids(40, seed=90)
        self.openings = [opening, opening[:23] + _ids(17, seed=91), _ids(20, seed=92)]
        self.logs: dict[str, list[int]] = {}  # session -> the tokens its KV holds
        self.background: tuple[str, list[int], object] | None = None  # a prefill_steps in flight
        self.reserving: tuple[str, object] | None = None  # a reserve_steps in flight
        self.checked = 0
        self.calls: list[tuple[int, str, str]] = []  # (step, call, session): what a failure's message shows

    def expect(self, sid: str, ids: list[int], row) -> None:
        assert _close(row, _hf_logits(self.model, ids)[-1]), sid
        self.logs[sid] = list(ids)
        self.checked += 1

    def new_ids(self, sid: str, step: int) -> list[int]:
        log = self.logs.get(sid)
        base = log if log and self.rng.random() < 0.7 else self.rng.choice(self.openings)
        cut = self.rng.randrange(1, len(base) + 1)
        return (base[:cut] + _ids(self.rng.randrange(1, 12), seed=7000 + step))[:MAX_TOKENS]

    # ---- what is in flight ------------------------------------------------------------------

    def settle(self, sid: str) -> None:
        """Before a call on ``sid``: close its generators in flight, as the engine loop drops its task."""
        if self.background and self.background[0] == sid:
            _, ids, steps = self.background
            steps.close()
            cached = list(self.engine.cached_token_ids(sid))
            # a prefix of the new tokens: at least what the old ones share with them (short of the last, which a
            # prefill recomputes), and maybe more, copied from a donor before the first layer
            held = min(common_prefix_length(self.logs.get(sid, []), ids), len(ids) - 1)
            assert cached == ids[:len(cached)] and len(cached) >= held, sid
            self.logs[sid] = cached
            self.background = None
        if self.reserving and self.reserving[0] == sid:
            self.reserving[1].close()
            self.reserving = None

    def advance(self) -> None:
        if self.background and self.rng.random() < 0.6:
            sid, ids, steps = self.background
            try:
                next(steps)
            except StopIteration as done:
                self.background = None
                self.expect(sid, ids, done.value)
        if self.reserving and self.rng.random() < 0.6:
            if next(self.reserving[1], StopIteration) is StopIteration:
                self.reserving = None

    # ---- one random call --------------------------------------------------------------------

    def step(self, step: int) -> None:
        rng, engine = self.rng, self.engine
        sid = rng.choice(SESSIONS)
        held = sid in self.logs
        op = rng.choice(["prefill", "prefill", "prefills", "decode", "batch", "truncate", "close", "share",
                         "background", "reserve", "drop kept"] if held else ["prefill", "prefills", "share"])
        self.calls.append((step, op, sid))
        if op == "prefills":
            sids = sorted({sid, *rng.sample(SESSIONS, 2)})
            for other in sids:
                self.settle(other)
            seqs = [self.new_ids(other, step * 10 + n) for n, other in enumerate(sids)]
            for other, ids, row in zip(sids, seqs, engine.prefill_batch(sids, seqs)):
                self.expect(other, ids, row)
            return
        self.settle(sid)
        if not self.logs.get(sid) and op in ("decode", "truncate", "close", "reserve"):
            op = "prefill"  # the closed prefill left it nothing
        if op == "prefill":
            ids = self.new_ids(sid, step)
            self.expect(sid, ids, engine.prefill(sid, ids))
        elif op == "decode":
            if len(self.logs[sid]) < MAX_TOKENS:
                t = rng.randrange(512)
                self.expect(sid, self.logs[sid] + [t], engine.decode(sid, t))
        elif op == "batch":
            for other in sorted(self.logs):
                self.settle(other)
            sids = [s for s in sorted(self.logs) if 0 < len(self.logs[s]) < MAX_TOKENS]  # decoding needs a prefix
            tokens = [rng.randrange(512) for _ in sids]
            for other, t, row in zip(sids, tokens, engine.decode_batch(sids, tokens)):
                self.expect(other, self.logs[other] + [t], row)
        elif op == "truncate":
            n = rng.randrange(1, len(self.logs[sid]) + 1)
            engine.truncate(sid, n)
            del self.logs[sid][n:]
        elif op == "close":
            log = self.logs.pop(sid)
            if rng.random() < 0.7:
                engine.keep_prefix(sid, rng.randrange(1, len(log) + 1))
            else:
                engine.release(sid)
        elif op == "share":  # a pre-positioning: what another session holds first, then the rest in chunks
            ids = self.new_ids(sid, step)
            done = engine.share_prefix(sid, ids)
            assert list(engine.cached_token_ids(sid))[:done] == ids[:done]
            end = done
            while True:
                end = min(len(ids), max(end, done) + rng.randrange(1, 9))
                row = engine.prefill(sid, ids[:end])
                self.expect(sid, ids[:end], row)
                if end == len(ids):
                    break
        elif op == "background":
            if self.background is None:
                ids = self.new_ids(sid, step)
                steps = engine.prefill_steps(sid, ids)
                next(steps)  # started, as the engine loop starts a task (2 layers: it yields after the first)
                self.background = (sid, ids, steps)
        elif op == "reserve":
            if self.reserving is None:
                self.reserving = (sid, engine.reserve_steps(sid, len(self.logs[sid]) + rng.randrange(1, 80)))
        else:
            engine.drop_kept_prefix()

    def check(self) -> None:
        engine = self.engine
        for sid in SESSIONS:
            cached = list(engine.cached_token_ids(sid))
            last = (sid, self.calls[-6:])
            if self.background and self.background[0] == sid:
                assert cached == self.background[1][:len(cached)], last
                continue
            assert cached == self.logs.get(sid, []), last
            if sid in self.logs:
                s = engine._sessions[sid]
                if isinstance(engine, PagedTorchLlamaEngine):
                    assert len(s.pages) * engine.page_tokens >= len(cached), last
                else:
                    assert s.kv.shape[3] >= len(cached), last
                assert s.listed == prefix_hashes(cached, len(cached))[:len(s.listed)], last  # never more than held


def _paged(path, **kw):
    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    from engines.test_torch_paged import _engine

    per_token = TorchLlamaEngine(path).info.kv_bytes_per_token
    return _engine(path, pool=400 * 4 * per_token, kept_prefixes=2)


ENGINES = {
    "cpu-kernels": lambda path: TorchLlamaEngine(path, kv_block_tokens=BLOCK, kept_prefixes=2),
    "torch-ops": lambda path: TorchLlamaEngine(path, kv_block_tokens=BLOCK, cpu_kernels=False, kept_prefixes=2),
    "paged": _paged,  # 4-token pages: shared pages written around at every turn
}


@pytest.mark.parametrize("which", sorted(ENGINES))
@pytest.mark.parametrize("seed", range(1, 1 + int(os.environ.get("PREPOS_RANDOM_SEEDS", "2"))))
def test_random_calls_keep_every_session_right(tied, which, seed):
    path, model = tied
    engine = ENGINES[which](path)
    mix = Mix(engine, model, seed)
    for step in range(120):
        mix.step(step)
        mix.advance()
        mix.check()
    for sid in SESSIONS:
        mix.settle(sid)
    assert mix.checked >= 100 and engine.num_shared_tokens > 0
    for sid in list(mix.logs):
        engine.release(sid)
    while engine.drop_kept_prefix():
        pass
    assert not engine._sessions and not len(engine._prefixes)
    if isinstance(engine, PagedTorchLlamaEngine):
        assert len(engine._free) == engine.num_pages - 1 and not any(engine._holders)
