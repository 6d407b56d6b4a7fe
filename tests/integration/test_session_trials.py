"""A short run of the session trials (loadtest/session_trials.py) on the real server: sessions driven every way
the protocol allows, with a restart on the journals halfway, answer exactly as calm twins do."""

from __future__ import annotations

import pytest

import session_trials

pytestmark = pytest.mark.integration


def test_sessions_driven_every_way_answer_as_calm_twins_across_a_restart(tmp_path):
    counts = session_trials.trial(tmp_path, number=7, num_sessions=2, num_actions=10)
    assert counts["restarts"] == 1 and counts["replayed"] >= 5, counts
    assert counts["errors"] == 0 and counts["differed"] == 0, counts
