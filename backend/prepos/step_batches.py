"""The engine loop's batches of engine steps: prefills and decodes of several sessions in one engine call.

A foreground request about to prefill or decode yields its
:class:`~prepos.serving.PrefillStep` or :class:`~prepos.serving.DecodeStep`
to the loop, which hands it here to wait. Once every other session that was
ready when the first step began waiting has had one step, the waiting
prefills run as one batch (``Engine.prefill_batch``), else the waiting
decodes (``Engine.decode_batch``): one read of the weights for all of each. A
prefill too long for one batch comes in pieces, and its later pieces take turns
with the waiting decodes.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Iterator

from prepos.config import SchedulerConfig
from prepos.engines.base import Engine
from prepos.metrics import Metrics
from prepos.serving import EngineStep, PrefillStep
from prepos.session import Session

log = logging.getLogger("prepos.scheduler")


def batches(steps: list[EngineStep], size: int, max_tokens: int | None = None) -> Iterator[list[EngineStep]]:
    """``steps`` in order, cut into batches of at most ``size`` steps and (prefills) ``max_tokens`` new tokens;
    a prefill longer than ``max_tokens`` (none comes from the request server, which cuts long ones in pieces)
    goes alone."""
    batch: list[EngineStep] = []
    tokens = 0
    for step in steps:
        n = step.new_tokens if max_tokens is not None else 0
        if batch and (len(batch) == size or (max_tokens is not None and tokens + n > max_tokens)):
            yield batch
            batch, tokens = [], 0
        batch.append(step)
        tokens += n
    if batch:
        yield batch


class StepBatches:
    """Engine steps waiting for their batch, and the round of other sessions' steps due before it runs."""

    def __init__(self, *, engine: Engine, config: SchedulerConfig, metrics: Metrics, clock: Callable[[], float],
                 done: Callable[[float], float]):
        """``done(began)``: count the foreground engine time since ``began``; returns those seconds."""
        self._engine = engine
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._done = done
        self.waiting: list[tuple[Session, EngineStep]] = []  # requests waiting for the next batch of engine steps
        self._round_left = 0  # steps of other ready sessions still due before that batch runs
        self._last_kind = ""  # what the last batch ran: "prefill" or "decode"

    def add(self, session: Session, step: EngineStep, ready: deque[Session]) -> None:
        """The session's request waits for its step to run; the sessions ready now get one step each first."""
        if not self.waiting:
            self._round_left = len(ready)
        self.waiting.append((session, step))

    def stepped(self) -> None:
        """A ready session took one step."""
        self._round_left -= 1

    def due(self, ready: deque[Session]) -> bool:
        """Whether the waiting steps run now: some wait, and no ready session is still due a step before them."""
        return bool(self.waiting) and (not ready or self._round_left <= 0)

    def run(self, ready: deque[Session]) -> None:
        """Run the next batch of waiting engine steps and hand each of its requests its logits, or the error that
        made its step impossible (the request's own error handling answers its client): the first waiting
        prefills (at most ``max_prefill_batch`` sessions and ``max_prefill_batch_tokens`` new tokens), else every
        waiting decode (in batches of at most ``max_decode_batch``); where the last batch was a prefill and decodes
        wait, a long prefill's later pieces (:class:`PrefillStep`) wait for them. The sessions
        whose requests resume go back to ``ready``, and each takes a step (a prefill's first token goes out) before
        the next batch runs; steps no longer wanted are not run, and their requests stop when resumed."""
        waiting, resumed = [], []
        for session, step in self.waiting:
            (waiting if step.wanted() else resumed).append((session, step))
        prefills = [step for _, step in waiting if isinstance(step, PrefillStep)]
        config = self._config
        if len(prefills) < len(waiting) and self._last_kind == "prefill":
            # A long prefill's later pieces and the waiting decodes take turns, so no answer stalls for more than
            # one piece; new requests' first prefills still go first.
            prefills = [step for step in prefills if not step.later_piece]
        if prefills:
            chosen = next(batches(prefills, config.max_prefill_batch, config.max_prefill_batch_tokens))
            self._run_steps("prefill", [chosen],
                            lambda steps: self._engine.prefill_batch([st.session_id for st in steps],
                                                                     [st.token_ids for st in steps]))
        else:
            chosen = [step for _, step in waiting if not isinstance(step, PrefillStep)]
            self._run_steps("decode", batches(chosen, config.max_decode_batch),
                            lambda steps: self._engine.decode_batch([st.session_id for st in steps],
                                                                    [st.token_id for st in steps]))
        ran = {id(step) for step in chosen}
        self.waiting = [(session, step) for session, step in waiting if id(step) not in ran]
        ready.extend(session for session, _ in resumed)
        ready.extend(session for session, step in waiting if id(step) in ran)
        if self.waiting:
            self._round_left = len(ready)

    def _run_steps(self, kind: str, batched: Iterator[list], run: Callable[[list], list]) -> None:
        for steps in batched:
            began = self._clock()
            try:
                results = run(steps)
            except Exception as err:  # the engine failed as a whole: every request in the batch fails with it
                log.exception("a batch of %d %ss failed", len(steps), kind)
                results = [err] * len(steps)
            for step, result in zip(steps, results):
                if isinstance(result, Exception):
                    step.error = result
                else:
                    step.logits = result
            seconds = self._done(began)
            for step in steps:
                step.seconds = seconds
            self._metrics.engine_batch(kind, len(steps))
            self._last_kind = kind
