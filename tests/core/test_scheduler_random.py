"""Random interleavings of many sessions' requests, every answer checked against a reference.

Each run draws a few hundred actions from a seeded generator: sessions opened (ids reused after they end, some
with the same system turn, so that their prefixes are shared), questions (free, over ``choices``, with stop
strings, sampled with a seed, or under an always-firing gate), updates, ends, deadlines and clients that go away,
a few steps of the engine loop at a time (so that requests of different sessions overlap, batch together and cut
pre-positioning short), idle time, and now and then the loop run until it has nothing left to do. A session's
requests may be sent before the ones ahead of them are answered (they take effect in order); each one's expected
outcome is worked out when it reaches the head of its session's queue: the answer of a stateless prefill of the
log as the test's own model of it holds it then. With journals, the server is also restarted now and then, and
each session's journal must hold exactly its acknowledged turns. Checked as it goes: every answer, every log
(against the model), the KV budget (passed only while the sessions being served hold more than it); at the end,
no request left unanswered and no KV or journal left behind.
"""

from __future__ import annotations

import os
import random
from collections import deque

import numpy as np
import pytest

from fakes import IM_END, CollectSink, write_tiny_llama
from prepos.journal import SessionJournal
from prepos.protocol import Sampling, Status
from prepos.scan import scan_numpy
from test_scheduler import Harness, choice_reference

SYSTEMS = ("You route tool calls.", "You answer yes or no.", "sys")
WORDS = ("get", "weather", "in", "Paris", "now", "alarm", "7am", "list", "files", "ok", "")
CHOICES = (("yes", "no"), ("yes", "no", "yesterday"), ("get_weather", "get_time", "set_alarm"))
SEEDS = int(os.environ.get("PREPOS_RANDOM_SEEDS", "4"))  # runs per configuration (more: a longer hunt)
MAX_LOG = 1500  # a session past this many tokens is ended (the fake engine's context is 4096)

CONFIGS = {
    # room for every session's KV; every gated answer audited against the full path in the background
    "roomy": dict(gate_kw={"watch_fraction": 1.0}),
    # a KV budget for a few sessions (evictions, rebuilds, speculative state dropped), prefill in layer steps
    # (a request waits a layer, not a prefill), small chunks, shared prefixes
    "tight": dict(kv_budget=100 * 900, num_layers=3, chunk_tokens=8, share_prefixes=True),
    # shared prefixes held by reference (as the paged engine's pages): the budget counts them once, and a
    # session whose KV others all hold goes after those that free bytes
    "references": dict(kv_budget=100 * 700, share_prefixes=True, by_reference=True, chunk_tokens=8),
    # one session per decode and prefill step, room made and dropped between
    "unbatched": dict(max_decode_batch=1, max_prefill_batch=1, kv_budget=100 * 1500, share_prefixes=True),
    # session journals, and the server restarted now and then: what was in flight is lost, every session reopens
    # from its journal (START with resume) with the turns acknowledged before
    "restarts": dict(journaled=True, kv_budget=100 * 1500),
    # the torch engine itself (a tiny random Llama, 512 bytes of KV per token) under a budget for a few sessions,
    # with shared prefixes and kept openings, against its own stateless prefill
    "torch": dict(torch_engine=True, kv_budget=512 * 900, chunk_tokens=8, gate_kw={"watch_fraction": 1.0}),
    # logs of at most 300 tokens, the oldest turns after the first dropped to make room, with restarts: the
    # journals must follow the drops
    "overflow": dict(context_overflow="drop_oldest", max_log_tokens=300, journaled=True),
    # pre-positioning with a placeholder where the delta will go, responses of three tokens, next-use eviction
    "placeholder": dict(speculative_delta="(message)", stream_interval=3, eviction_policy="next_use",
                        kv_budget=100 * 1200),
    # one-token chunks, small prefill batches, a pause before background work, the least recent session first
    "fine": dict(chunk_tokens=1, max_prefill_batch_tokens=16, background_delay_ms=5.0, idle_policy="least_recent",
                 num_layers=2),
    # no KV kept between requests: every request prefills the whole log
    "stateless": dict(retain_kv=False),
}


class Run:
    def __init__(self, tmp_path, seed: int, config: dict):
        self.tmp_path, self.config = tmp_path, dict(config)
        self.journal_dir = tmp_path / f"journal-{seed}" if self.config.pop("journaled", False) else None
        self.h = self.server()
        self.rng = random.Random(seed)
        self.resume: set[str] = set()  # sessions the restarted server does not hold yet
        self.restarts = 0
        self.model: dict[str, list[list[int]]] = {}  # open session -> its turns, as this test expects them
        # session -> its requests not yet checked, in order: sink, what the request is (for its expectation, worked
        # out once it is at the head), flags set when it was sent, and the expectation itself
        self.queues: dict[str, deque[dict]] = {}
        self.ending: set[str] = set()  # an END sent, not yet answered: nothing more is sent to them
        self.closed: list[str] = []
        self.next_id = 0
        self.answered = self.stopped = self.pipelined = 0
        self.paths: set[str] = set()

    def server(self) -> Harness:
        journal = SessionJournal(self.journal_dir, fsync=False) if self.journal_dir else None
        config = dict(self.config)
        if config.pop("torch_engine", False):
            config.update(_torch_engines(self.tmp_path))
        h = Harness(self.tmp_path, max_sessions=64, journal=journal, **config)
        self.noted: dict = {}  # session -> the KV it held when the ledger last recorded it (see unsettled)
        ledger = h.sched._residency.kv
        record, forget = ledger.record, ledger.forget

        def recording(session_id, *args):
            record(session_id, *args)
            self.noted[session_id] = tuple(h.engine.cached_token_ids(session_id))

        def forgetting(session_id):
            forget(session_id)
            self.noted[session_id] = ()

        if self.config.get("by_reference"):  # only there does the ledger read a live total (see unsettled)
            ledger.record, ledger.forget = recording, forgetting
        return h

    def log(self, sid: str) -> list[int]:
        return [t for turn in self.model[sid] for t in turn]

    def fit(self, sid: str, num_new: int, answer_room: int) -> list[list[int]] | None:
        """The session's turns once ``num_new`` more tokens and ``answer_room`` for the answer fit its log: under
        ``drop_oldest``, its oldest turns after the first dropped as needed; None when they cannot fit."""
        turns, limit = list(self.model[sid]), self.config.get("max_log_tokens") or 10**9
        while sum(map(len, turns)) + num_new + answer_room > limit and len(turns) > 1 \
                and self.config.get("context_overflow") == "drop_oldest":
            del turns[1]
        return turns if sum(map(len, turns)) + num_new + answer_room <= limit else None

    def sampled(self, sequence: list[int], max_tokens: int, sampling: Sampling) -> list[int]:
        """The seeded sampled answer to a stateless prefill of ``sequence``: one uniform draw per token."""
        rng, seq, out = np.random.default_rng(sampling.seed), list(sequence), []
        while len(out) < max_tokens:
            token = scan_numpy(self.h.logits_of(seq), temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=sampling.top_p, uniform=float(rng.random())).token_id
            out.append(token)
            seq.append(token)
            if token == IM_END:
                break
        return out

    def speculative(self, prompt: list[int], text: str) -> list[int]:
        """The sequence a session's pre-positioning prefilled for ``prompt``: the placeholder (none by default)
        where the delta ``text`` goes."""
        placeholder = self.h.tok.encode(self.config.get("speculative_delta", ""))
        return [*prompt[:len(prompt) - len(self.h.framing.cue_ids) - len(self.h.tok.encode(text))], *placeholder,
                *self.h.framing.cue_ids]

    def stopped_reference(self, sequence: list[int], max_tokens: int, stop: list[str]) -> tuple[list[int], str]:
        """The greedy answer's tokens, up to the one that completes a stop string, and its text cut before it."""
        seq, ids = list(sequence), []
        while len(ids) < max_tokens:
            token = int(np.argmax(self.h.logits_of(seq)))
            if token == IM_END:
                break
            ids.append(token)
            seq.append(token)
            if any(s in self.h.tok.decode(ids) for s in stop):
                break
        text = self.h.tok.decode(ids)
        return ids, text[:min([text.find(s) for s in stop if s in text], default=len(text))]

    def run_once(self) -> None:
        """One step of the engine loop; the fake engine moves the clock as it computes, a real one by 5 ms."""
        if self.config.get("torch_engine"):
            self.h.clock.t += 0.005
        self.h.sched.run_once()

    # ---- actions ---------------------------------------------------------------------------

    def restart(self) -> None:
        """The server goes away between two engine steps and a new one starts on the same journals."""
        if self.ending or any(item["what"]["kind"] == "start" for queue in self.queues.values() for item in queue):
            return  # a START or END in flight: whether it took effect is the client's to find out
        journal = self.h.sched._residency._journal
        for sid in self.model:  # what was acknowledged, exactly
            assert journal.recover(sid).token_log == self.log(sid), sid
        self.queues.clear()  # their turns were not accepted: the models stand
        self.h = self.server()
        self.resume = set(self.model)
        self.restarts += 1

    def pick_session(self) -> tuple[str | None, bool]:
        """An open session to send to, and whether it has nothing in flight (now and then one that has)."""
        open_ = [sid for sid in self.model if sid not in self.ending]
        idle = [sid for sid in open_ if not self.queues.get(sid)]
        if open_ and (not idle or self.rng.random() < 0.25):
            sid = self.rng.choice(open_)
            return sid, not self.queues.get(sid)
        return (self.rng.choice(idle), True) if idle else (None, False)

    def send(self, sid: str, text: str | None, what: dict, **kw) -> None:
        flags = {}
        if sid in self.resume:
            self.resume.discard(sid)
            kw.update(start=True, resume=True)
            flags["resumed"] = True
        elif what["kind"] in ("ask", "append") and self.rng.random() < 0.12:
            kw["deadline_s"] = self.h.clock() + self.rng.choice((0.001, 0.01, 0.05, 0.3))
            flags["may_stop"] = True  # by its deadline, unless it is answered first
        queue = self.queues.setdefault(sid, deque())
        self.pipelined += bool(queue)
        sink = self.h.submit(self.h.request(sid, text, **kw))
        queue.append({"sink": sink, "what": dict(what, text=text, kw=kw), "flags": flags, "expect": None})
        if len(queue) == 1:
            self.work_out(sid)

    def cancel(self) -> None:
        items = [item for queue in self.queues.values() for item in queue if item["what"]["kind"] == "ask"]
        if items:
            item = self.rng.choice(items)
            item["sink"].client_gone, item["flags"]["may_stop"] = True, True

    def start(self) -> None:
        if self.closed and self.rng.random() < 0.5:
            sid = self.closed.pop(self.rng.randrange(len(self.closed)))  # an id used before
        else:
            sid, self.next_id = f"s{self.next_id}", self.next_id + 1
        self.model[sid] = []
        self.send(sid, self.rng.choice(SYSTEMS), {"kind": "start"}, start=True, max_tokens=0, role="system")

    def ask(self, sid: str) -> None:
        text = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(0, 3))).strip()
        role = self.rng.choice(("user", "user", "tool"))
        choices = self.rng.choice(CHOICES) if self.rng.random() < 0.25 else None
        kw = dict(role=role, choices=choices, max_tokens=8 if choices else self.rng.randint(1, 6))
        if not choices and not self.config.get("torch_engine") and self.rng.random() < 0.15:  # sampled, seeded
            kw["sampling"] = Sampling(temperature=self.rng.choice((0.7, 1.0, 1.5)), top_p=self.rng.choice((1.0, 0.9)),
                                      top_k=self.rng.choice((0, 5)), seed=self.rng.randrange(2**32))
        elif not choices and self.rng.random() < 0.15:  # stop strings: the text ends before the first
            kw["stop"] = tuple(self.rng.sample([*"aeiostnrl ,.", "in", "er"], self.rng.randint(3, 8)))
        elif self.rng.random() < 0.3:  # the gate always fires
            kw["gate_threshold"] = 0.0
        self.send(sid, text, {"kind": "ask"}, **kw)

    def append(self, sid: str) -> None:
        text = (self.rng.choice([w for w in WORDS if w]) + " " + self.rng.choice(WORDS)).strip()
        self.send(sid, text, {"kind": "append"}, role=self.rng.choice(("user", "tool", "system")), max_tokens=0)

    def end(self, sid: str) -> None:
        self.ending.add(sid)
        self.send(sid, None, {"kind": "end"}, end=True, max_tokens=0)

    def step(self) -> None:
        r = self.rng.random()
        sid, idle = self.pick_session()
        if r < 0.06 or not self.model:
            if len(self.model) < 12:
                self.start()
        elif r < 0.30 and sid is not None:
            self.ask(sid)
        elif r < 0.38 and sid is not None:
            self.append(sid)
        elif r < 0.41 and sid is not None and idle:
            self.end(sid)
        elif r < 0.43:
            self.cancel()
        elif r < 0.45 and self.journal_dir:
            self.restart()
        elif r < 0.85:
            for _ in range(self.rng.randint(1, 6)):
                self.run_once()
        elif r < 0.93:
            self.h.clock.t += self.rng.choice((0.01, 0.5, 3.0))
            self.run_once()
        else:
            self.h.idle()  # everything answered and every session positioned
        self.check()

    # ---- expectations ------------------------------------------------------------------------

    def work_out(self, sid: str) -> None:
        """The expectation of the request at the head of the session's queue, from the model of its log now."""
        item = self.queues[sid][0]
        what = item["what"]
        kind, text, kw = what["kind"], what["text"], what["kw"]
        if kind == "start":
            turn = [*self.h.framing.entry_ids["system"], *self.h.tok.encode(text), *self.h.framing.close_ids]
            expect = {"log": turn, "turns": [], "append": True}
        elif kind == "end":
            expect = {"append": True, "end": True}
        elif kind == "append":
            log = self.log(sid)
            turn = [*self.h.framing.opening_ids(not log, kw["role"]), *self.h.framing.entry_ids[kw["role"]],
                    *self.h.tok.encode(text), *self.h.framing.close_ids]
            turns = self.fit(sid, len(turn), 0)
            expect = {"reject": "text_input"} if turns is None else {"log": turn, "turns": turns, "append": True}
        else:
            expect = self.ask_expect(sid, text, kw)
        item["expect"] = expect

    def ask_expect(self, sid: str, text: str, kw: dict) -> dict:
        role, choices, max_tokens = kw["role"], kw["choices"], kw["max_tokens"]
        closing = list(self.h.framing.answer_terminator_ids)
        drop = self.config.get("context_overflow") == "drop_oldest"
        # every choice set here diverges at its first token: no leading tokens are forced
        answer_room = (max(len(self.h.tok.encode(c)) for c in choices) + 1 if choices
                       else max_tokens if drop else 1) + len(closing)
        log = self.log(sid)
        part = [*self.h.framing.opening_ids(not log, role), *self.h.framing.entry_ids[role], *self.h.tok.encode(text),
                *self.h.framing.cue_ids]
        turns = self.fit(sid, len(part), answer_room)
        if turns is None:  # what is too long is named: choices or max_tokens when the turn fits a one-token answer
            fits_alone = self.fit(sid, len(part), 1 + len(closing)) is not None
            return {"reject": ("choices" if choices else "max_tokens") if fits_alone else "text_input"}
        prompt = [t for turn in turns for t in turn] + part
        gated = kw.get("gate_threshold") == 0.0
        if choices:
            answer = choice_reference(self.h, prompt, choices)
            expect = {"text": answer, "turns": turns, "log": part + self.h.tok.encode(answer) + closing}
            if gated:  # the first token from the positioned distribution, the rest after the delta
                gated_text = choice_reference(self.h, prompt, choices, first=self.speculative(prompt, text))
                expect.update(prompt_part=part, gated_text=gated_text)
            return expect
        if "sampling" in kw:
            ids = [t for t in self.sampled(prompt, max_tokens, kw["sampling"]) if t != IM_END]
            return {"ids": ids, "turns": turns, "log": part + ids + closing}
        if "stop" in kw:  # the tokens and the log keep the stop string
            ids, text_out = self.stopped_reference(prompt, max_tokens, list(kw["stop"]))
            return {"ids": ids, "text": text_out, "turns": turns, "log": part + ids + closing}
        ids = [t for t in self.h.reference(prompt, max_tokens) if t != IM_END]
        expect = {"ids": ids, "turns": turns, "log": part + ids + closing}
        if gated:  # the first token from the distribution positioned with the placeholder (none by default) where
            # the delta goes, the rest after the delta
            first = self.h.reference(self.speculative(prompt, text), 1)[0]
            rest = self.h.reference(prompt + [first], max_tokens - 1) if first != IM_END and max_tokens > 1 else []
            expect.update(prompt_part=part, gated_first=first, gated_ids=[t for t in [first, *rest] if t != IM_END])
        return expect

    # ---- checks ----------------------------------------------------------------------------

    def check(self) -> None:
        for sid in list(self.queues):
            queue = self.queues[sid]
            while queue and queue[0]["sink"].done:
                item = queue.popleft()
                self.check_answer(sid, item["sink"], {**item["expect"], **item["flags"]})  # flags set since too
                if queue:
                    self.work_out(sid)
            if not queue:
                del self.queues[sid]
                if sid in self.model and len(self.log(sid)) > MAX_LOG:
                    self.end(sid)
        for sid in self.model:
            if sid not in self.queues and sid not in self.resume:
                assert self.h.log(sid) == self.log(sid), sid
        # Over the budget only while the sessions being served hold more than it: nothing else is left to free
        ledger = self.h.sched._residency.kv
        if ledger.used_bytes > ledger.budget_bytes and not self.unsettled():
            assert self.h.engine.kept_prefix_bytes() == 0
            for session in self.h.sched.store:
                assert not session.has_kv or session.serving or session.pending, session.session_id

    def unsettled(self) -> bool:
        """Whether a session holds other KV than when the ledger last recorded it (by reference only: the engine's
        total is live, where the ledger's sum changes as sessions note their KV, a step after the engine's)."""
        engine = self.h.engine
        return bool(self.config.get("by_reference")) and any(
            tuple(engine.kv.get(s.session_id, ())) != self.noted.get(s.session_id, ()) for s in self.h.sched.store)

    def check_answer(self, sid: str, sink: CollectSink, expect: dict) -> None:
        if expect.get("reject"):  # it cannot fit: an error naming the input, and nothing changes
            assert sink.error is not None and sink.error.field == expect["reject"], (sid, sink.error)
            return
        if sink.error is not None:  # stopped: its turn was not accepted
            assert expect.get("may_stop") and sink.error.status in (Status.CANCELLED, Status.DEADLINE_EXCEEDED), (
                sid, sink.error)
            if sink.chunks and sink.path == "gated" and "gated_text" in expect:
                assert sink.ids == self.h.tok.encode(expect["gated_text"])[:len(sink.ids)], sid
            elif sink.chunks and sink.path == "gated":
                assert sink.ids[:1] == [expect["gated_first"]][:len(sink.ids)], sid
            elif "text" in expect and "ids" not in expect:  # a choice
                assert sink.ids == self.h.tok.encode(expect["text"])[:len(sink.ids)], sid
            else:
                assert sink.ids == expect.get("ids", sink.ids)[:len(sink.ids)], sid  # what it streamed was right
            self.stopped += 1
            return
        if sink.path == "gated" and "gated_text" in expect:  # a choice
            assert sink.text == expect["gated_text"], (sid, "gated choice")
            expect["text"] = sink.text
            expect["log"] = expect["prompt_part"] + sink.ids + list(self.h.framing.answer_terminator_ids)
        elif sink.path == "gated":
            assert expect.get("gated_first") is not None, sid
            assert (sink.ids or [IM_END])[0] == expect["gated_first"], sid
            assert sink.ids == expect["gated_ids"], (sid, "gated continuation")
            expect["ids"] = sink.ids
            expect["log"] = expect["prompt_part"] + sink.ids + list(self.h.framing.answer_terminator_ids)
        if expect.get("append"):
            assert sink.error is None, (sid, sink.error)
            assert sink.chunks[-1].finish_reason == ("closed" if expect.get("end") else "appended"), sid
        elif "ids" in expect:
            assert sink.ids == expect["ids"], (sid, sink.path, sink.chunks[-1].finish_reason)
            if "text" in expect:
                assert sink.text == expect["text"], (sid, sink.path)
        else:
            assert sink.text == expect["text"], (sid, sink.path)
        if not expect.get("append"):
            self.answered += 1
            self.paths.add(sink.path)
            assert sink.path == "rebuild" or not expect.get("resumed"), (sid, sink.path)
        if expect.get("end"):
            del self.model[sid]
            self.ending.discard(sid)
            self.closed.append(sid)
            assert self.h.sched.store.get(sid) is None
            return
        self.model[sid] = [*expect["turns"], expect["log"]]  # its turns made room for, and its own


def _torch_engines(tmp_path) -> dict:
    """The engine served, and the reference: a second engine prefilling each sequence whole in a fresh session."""
    from prepos.engines.torch_llama import TorchLlamaEngine

    path = tmp_path / "tiny-llama"
    if not path.exists():
        write_tiny_llama(path, tie=True, max_context=4096)
    engine = TorchLlamaEngine(str(path), kv_block_tokens=16, kept_prefixes=2)
    stateless = TorchLlamaEngine(str(path), share_prefixes=False)

    def reference_logits(seq):
        stateless.release("reference")
        return stateless.prefill("reference", list(seq)).numpy()

    return dict(engine=engine, reference_logits=reference_logits)


def _run(tmp_path, seed: int, config: dict) -> Run:
    run = Run(tmp_path, seed, config)
    for _ in range(400):
        run.step()
    for sid in list(run.model):  # finish what is in flight, then end every session
        for _ in range(10_000):
            if sid not in run.queues:
                break
            run.run_once()
            run.check()
        if sid in run.model and sid not in run.ending:  # not ended already, for its length
            run.end(sid)
    run.h.idle()
    run.check()
    assert not run.queues and not run.model
    engine = run.h.engine
    if config.get("torch_engine"):  # every session's KV released; only kept openings stay
        assert all(isinstance(key, tuple) for key in engine._sessions) and engine.num_shared_tokens > 0
    else:
        assert set(engine.kv) == set(engine.kept)
    kept = engine.kv_total_bytes() if config.get("by_reference") else engine.kept_prefix_bytes()
    assert run.h.sched._residency.kv.used_bytes == kept
    if run.journal_dir:
        assert SessionJournal(run.journal_dir).session_ids() == []  # every END deleted its journal
    return run


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_random_interleavings_answer_like_a_stateless_prefill(tmp_path, config):
    paths, answered, stopped, evictions, restarts, pipelined = set(), 0, 0, 0, 0, 0
    for seed in range(SEEDS):
        run = _run(tmp_path, seed, CONFIGS[config])
        paths |= run.paths
        answered, stopped = answered + run.answered, stopped + run.stopped
        evictions += run.h.metrics.sink.get("prepos_kv_evictions_total", what="kv")
        restarts += run.restarts
        pipelined += run.pipelined
    # what the runs went through, together
    assert answered >= 160 and stopped > 0 and pipelined > 0
    if CONFIGS[config].get("retain_kv") is False:  # nothing kept, nothing positioned
        assert "rebuild" in paths and not paths & {"exact", "gated", "prepaid"}, paths
    else:  # with a placeholder positioned where the delta goes, no turn is exactly the positioned one
        assert {"prefix", "prepaid", "gated"} | ({"exact"} if "speculative_delta" not in CONFIGS[config] else set()) \
            <= paths, paths
    if CONFIGS[config].get("kv_budget"):
        assert evictions > 0 and "rebuild" in paths
    if CONFIGS[config].get("journaled"):
        assert restarts >= 4
