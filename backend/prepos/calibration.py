"""Calibration replay: the gate's features and their ground truth at every decision point of a trace.

Ground truth needs no labels. For a request with a non-empty delta the
reference answer is what the full path gives (log + entry + delta + cue); the
gate instead scans the speculative distribution (log + entry + speculative
delta + cue), where the speculative delta is empty or a placeholder text. The
replay drives an engine directly, in process, and for every decision point
prefills each speculative sequence and then the full sequence (one engine
session per replayed session: prefix reuse makes each a short prefill), scans them under the
same ``choices`` constraint, and records the speculative features and whether
the first decision token (after any forced choice tokens) agrees with the full
path's — which is exactly whether a gated answer would equal the full path's.

After each decision point the session's log grows by the full path's answer
(greedy; constrained choices are completed through the trie), as if the
server had answered it; updates (``max_tokens == 0``) append their delta.

Records go to an append-only JSONL file keyed by ``(session, turn)``; a rerun
with the same file skips decision points already recorded (it rebuilds their
logs from the recorded answers without touching the engine), so a long trace
can be calibrated in pieces.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from prepos.calibration_records import (EMPTY, RECORDS_FORMAT, DecisionRecord, SessionLike,  # noqa: F401 (API)
                                        SpeculativeFeatures, StepLike, check_not_in_use, check_resumable,
                                        end_last_line, locked_for_appending, read_records, records_header,
                                        steps_digest)
from prepos.engines.base import Engine
from prepos.scan import ScanFn, ScanResult, scan_numpy
from prepos.template import ChoiceTrie, Framing, Tokenizer

log = logging.getLogger("prepos.calibration")

ENGINE_SESSION = "calibrate"  # the one engine session a replay uses, released when the run ends


def is_decision_point(step: StepLike) -> bool:
    """Whether the gate decides this step: it asks for an answer (``max_tokens`` not 0) and brings a delta (an
    empty-delta request is answered from the cached distribution exactly, without the gate)."""
    return step.max_tokens != 0 and bool(step.delta)


def check_replayable(sessions: Iterable[SessionLike], framing: Framing) -> None:
    """Raise ValueError naming the session, step and field of the first step the server would refuse (a role the
    model has no framing for, a negative ``max_tokens`` (the upper limit is the server's setting; the replay caps
    answers at its own), ``choices`` empty, with an empty or a
    repeated entry, or with ``max_tokens`` 0), or when there is no step at all: a replay records decision points
    only of requests the server would answer (a repeated choice, always agreed on, would flatter the gate).
    Raise ValueError too when no step is a decision point (:func:`is_decision_point`), saying why: more sessions
    like these would add none."""
    num_steps = num_questions = num_points = 0
    for session in sessions:
        for index, step in enumerate(session.steps):
            num_steps += 1
            num_questions += step.max_tokens != 0
            num_points += is_decision_point(step)
            where = f"session {session.name!r} step {index}"
            if step.role not in framing.entry_ids:
                raise ValueError(f"{where}: role: unknown role {step.role!r}; the model frames "
                                 f"{', '.join(sorted(framing.entry_ids))}")
            if step.max_tokens < 0:
                raise ValueError(f"{where}: max_tokens: must be >= 0, got {step.max_tokens}")
            if step.choices is None:
                continue
            problem = ("empty list" if not step.choices else "an empty entry" if not all(step.choices)
                       else "duplicate entries" if len(set(step.choices)) != len(step.choices)
                       else "needs max_tokens >= 1" if step.max_tokens == 0 else None)
            if problem is not None:
                raise ValueError(f"{where}: choices: {problem}")
    if not num_steps:
        raise ValueError("no steps to replay")
    if not num_points:
        raise ValueError("no decision points: " + (
            f"each of the {num_questions} steps that ask for an answer has an empty delta, answered exactly "
            "without the gate" if num_questions else "no step asks for an answer (max_tokens is 0 on every one)")
            + "; a decision point is a step with max_tokens other than 0 and a non-empty delta")


@dataclass(frozen=True)
class ReplaySummary:
    """What one replay run did."""

    num_recorded: int  # decision points recorded by this run
    num_skipped: int  # decision points found already recorded
    elapsed_s: float


class ReplayInterrupted(KeyboardInterrupt):
    """A replay stopped by Ctrl-C; ``summary`` says what it recorded before (every record written is whole)."""

    def __init__(self, summary: ReplaySummary):
        super().__init__(f"interrupted after {summary.num_recorded} decision points recorded")
        self.summary = summary


class _Progress:
    def __init__(self, total: int, stream=None):
        stream = stream or sys.stderr  # the stderr of now, not of import time
        self.total, self.done, self.stream = total, 0, stream
        self.start = time.monotonic()
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._last = 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if not self._tty and now - self._last < 10 and self.done < self.total:
            return
        self._last = now
        rate = self.done / max(1e-9, now - self.start)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        width = 30
        filled = int(width * self.done / max(1, self.total))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} decision points, "
                f"{rate:.2f}/s, eta {eta:.0f} s")
        self.stream.write(("\r" if self._tty else "") + line + ("" if self._tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")


class CalibrationReplay:
    """Replays sessions against an engine and appends one :class:`DecisionRecord` per decision point.

    ``placeholders`` maps variant names to speculative delta texts; the empty
    delta (variant ``empty``) is always included. Decision points are the
    steps with ``max_tokens != 0`` and a non-empty delta; others only grow the
    log. Records are written in the order sessions are replayed (sessions
    sharing their opening turn together); the engine session used is
    released when the run ends.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, framing: Framing, *,
                 placeholders: dict[str, str] | None = None, scan: ScanFn = scan_numpy,
                 max_answer_tokens: int = 32):
        placeholders = dict(placeholders or {})
        if EMPTY in placeholders:
            raise ValueError(f"placeholders: the name {EMPTY!r} is reserved for the empty speculative delta")
        if any(not text for text in placeholders.values()):
            raise ValueError("placeholders: a placeholder text must not be empty (the empty delta is always compared)")
        self._engine, self._tokenizer, self._framing, self._scan = engine, tokenizer, framing, scan
        self._variants = {EMPTY: (), **{name: tuple(tokenizer.encode(t)) for name, t in placeholders.items()}}
        self._placeholders = placeholders
        self._max_answer_tokens = max_answer_tokens
        self._terminator_id = framing.answer_terminator_ids[0]
        self._max_context = engine.info.max_context

    def header(self) -> dict:
        return records_header(self._placeholders)

    def run(self, sessions: Iterable[SessionLike], records_path: str | Path, *,
            max_points: int | None = None, progress_stream=None) -> ReplaySummary:
        """Record every decision point of ``sessions`` not yet in ``records_path`` (at most ``max_points`` in all).

        Raises ``ValueError`` when the file was written with other placeholders or from other steps
        (:func:`check_resumable`), or another run is writing to it, and :class:`ReplayInterrupted` on Ctrl-C (the
        records written so far stay; a rerun skips them).
        """
        records_path = Path(records_path)
        sessions = list(sessions)
        records_path.parent.mkdir(parents=True, exist_ok=True)
        with locked_for_appending(records_path) as out:
            done = check_resumable(records_path, sessions, self._placeholders)
            points = [(s.name, i) for s in sessions for i, step in enumerate(s.steps) if is_decision_point(step)]
            if max_points is not None:
                points = points[:max_points]
            wanted = set(points)
            todo = [p for p in points if p not in done]
            progress = _Progress(len(todo), progress_stream)
            end_last_line(records_path)
            start, num_new = time.monotonic(), 0
            # Sessions that open with the same turn run one after another: the engine session keeps that prefix.
            ordered = sorted(sessions, key=lambda s: (s.steps[0].role, s.steps[0].delta) if s.steps else ("", ""))
            try:
                if records_path.stat().st_size == 0:
                    out.write(json.dumps({"header": self.header()}, sort_keys=True) + "\n")
                for session in ordered:
                    if not any((session.name, i) in wanted and (session.name, i) not in done
                               for i in range(len(session.steps))):
                        continue
                    for record in self._replay_session(session, wanted, done):
                        out.write(record.to_json() + "\n")
                        out.flush()
                        num_new += 1
                        progress.step()
            except KeyboardInterrupt:
                raise ReplayInterrupted(ReplaySummary(num_new, len(wanted) - len(todo), time.monotonic() - start)) \
                    from None
            finally:
                self._engine.release(ENGINE_SESSION)
                progress.close()
        return ReplaySummary(num_new, len(wanted) - len(todo), time.monotonic() - start)

    def _replay_session(self, session: SessionLike, wanted: set, done: dict) -> Iterable[DecisionRecord]:
        framing, token_log = self._framing, []
        # One engine session for every sequence: each speculative prefill reuses the log, the full path then
        # reuses log + entry, the next turn reuses all of it, and the next replayed session its opening turn
        # when they share it (prefill keeps the longest common prefix).
        engine_id = ENGINE_SESSION
        last_wanted = max(i for i in range(len(session.steps)) if (session.name, i) in wanted)
        for index, step in enumerate(session.steps[:last_wanted + 1]):
            opening = framing.opening_ids(not token_log, step.role)
            entry = [*opening, *framing.entry_ids[step.role]]
            delta_ids = self._tokenizer.encode(step.delta) if step.delta else []
            if step.max_tokens == 0:
                if delta_ids:
                    token_log += [*entry, *delta_ids, *framing.close_ids]
                continue
            trie = ChoiceTrie(step.choices, self._tokenizer, self._terminator_id) if step.choices else None
            forced = trie.leading_ids() if trie else []
            key = (session.name, index)
            longest = max((len(ids) for ids in trie.token_ids), default=0) + 1 if trie else self._max_answer_tokens
            if len(token_log) + len(entry) + len(delta_ids) + len(framing.cue_ids) + longest > self._max_context:
                log.warning("session %s: turn %d does not fit the %d-token context; its remaining decision "
                            "points are not recorded", session.name, index, self._max_context)
                return
            if key in done:
                answer = list(done[key].answer_ids)
            elif not delta_ids or key not in wanted:
                answer = self._answer(engine_id, [*token_log, *entry, *delta_ids, *framing.cue_ids], forced,
                                      trie, step.max_tokens)
            else:
                record = self._decision(session.name, index, token_log, entry, delta_ids, forced, trie, step,
                                        engine_id, steps_digest(session.steps, index))
                answer = list(record.answer_ids)
                yield record
            token_log += [*entry, *delta_ids, *framing.cue_ids, *answer, *framing.closing_ids(answer)]

    def _scan_at(self, logits, trie: ChoiceTrie | None, answer: Sequence[int]) -> ScanResult:
        return self._scan(logits, allowed_ids=trie.allowed_ids(answer) if trie else None)

    def _decision(self, session: str, index: int, token_log: list[int], entry: list[int], delta_ids: list[int],
                  forced: list[int], trie: ChoiceTrie | None, step: StepLike, engine_id: str,
                  digest: str) -> DecisionRecord:
        scans = {}
        for name, spec_delta in self._variants.items():
            spec = [*token_log, *entry, *spec_delta, *self._framing.cue_ids, *forced]
            scans[name] = self._scan_at(self._engine.prefill(engine_id, spec), trie, forced)
        prompt = [*token_log, *entry, *delta_ids, *self._framing.cue_ids]
        answer = self._answer(engine_id, prompt, forced, trie, step.max_tokens)
        full_token = answer[len(forced)]
        variants = {
            name: SpeculativeFeatures(scan.token_id, scan.p_max, scan.margin, scan.entropy, scan.certainty,
                                      scan.num_allowed, scan.token_id == full_token)
            for name, scan in scans.items()
        }
        return DecisionRecord(session, index, len(delta_ids), len(trie.choices) if trie else 0, full_token,
                              tuple(answer), variants, digest)

    def _answer(self, engine_id: str, prompt: list[int], forced: list[int], trie: ChoiceTrie | None,
                max_tokens: int) -> list[int]:
        """The full path's greedy answer, as the server builds it (forced tokens, trie tails, stop tokens)."""
        limit = self._max_answer_tokens if max_tokens < 0 else min(max_tokens, self._max_answer_tokens)
        answer = list(forced)
        logits = self._engine.prefill(engine_id, [*prompt, *forced])
        while True:
            token = self._scan_at(logits, trie, answer).token_id
            answer.append(token)
            if trie and token == self._terminator_id:
                return answer
            if trie:
                answer.extend(trie.forced_ids(answer))
                if trie.finished(answer) is not None:
                    return answer
            elif token in self._framing.stop_token_ids or len(answer) >= max(1, limit):
                return answer
            logits = self._engine.prefill(engine_id, [*prompt, *answer])
