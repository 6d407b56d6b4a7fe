"""The session limit against Triton's sequence slots, on the real server: a START past ``memory.max_sessions``
is rejected at once (RESOURCE_EXHAUSTED), not held in Triton's backlog, and a bare END of the rejected id gives
its slot back; a configuration whose limit reaches the slots does not load."""

from __future__ import annotations

import time

import numpy as np
import pytest


from .conftest import repository_with, start_server
from .test_bad_input import _b, _i32, open_raw, send

pytestmark = pytest.mark.integration

SLOTS = 4


def _repository(tmp_path, slots: int):
    """A copy of the model repository's ``prepos`` model with ``slots`` sequence slots."""
    return repository_with(tmp_path, "max_candidate_sequences", slots)


def test_a_start_past_the_session_limit_is_rejected_at_once_and_its_end_frees_the_slot(tmp_path):
    server = start_server(tmp_path / "run", env={"PREPOS_MEMORY_MAX_SESSIONS": str(SLOTS - 1)},
                          repositories=[_repository(tmp_path, SLOTS)])
    try:
        url = server.grpc_url
        for sid in range(1, SLOTS):
            open_raw(url, sid)
        for attempt in range(3):  # each rejected START's bare END gives Triton's slot back
            began = time.monotonic()
            _, error = send(url, 100 + attempt, dict(text_input=_b("hi"), max_tokens=_i32(0)), start=True)
            assert error is not None and f"session {100 + attempt} not opened: too many open sessions" in error, error
            assert time.monotonic() - began < 30  # answered, not queued behind the idle timeout
            _, error = send(url, 100 + attempt, dict(max_tokens=_i32(0)), end=True)
        _, error = send(url, 1, dict(max_tokens=_i32(0)), end=True)  # a session ends: the next START fits
        assert error is None, error
        open_raw(url, 200)
        ids, error = send(url, 200, dict(text_input=_b("Name a colour."), max_tokens=_i32(2),
                                         speculate=np.array([False])))
        assert error is None and len(ids) == 2
    finally:
        server.stop()


def test_a_session_limit_that_reaches_the_sequence_slots_fails_to_load_naming_the_key(tmp_path):
    with pytest.raises(RuntimeError) as failed:  # the launcher's error names the model's reason
        server = start_server(tmp_path / "run", env={"PREPOS_MEMORY_MAX_SESSIONS": str(SLOTS)},
                              repositories=[_repository(tmp_path, SLOTS)])
        server.stop()
    assert "models that failed to load:" in str(failed.value)
    assert f"memory.max_sessions: {SLOTS} must be below Triton's sequence slots" in str(failed.value)
