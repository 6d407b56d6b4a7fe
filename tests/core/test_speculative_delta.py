"""Pre-positioning with a placeholder where the delta will go (gate.speculative_delta)."""

from __future__ import annotations

import numpy as np

from fakes import IM_END, hashed_logits
from test_scheduler import Harness, expected, open_session


def test_a_placeholder_is_speculation_even_for_an_empty_delta(tmp_path):
    h = Harness(tmp_path, threshold=0.0, speculative_delta="...")
    open_session(h)
    h.idle()
    positioned = h.sched.store.lookup("s1").positioned
    assert positioned is not None and positioned.delta_ids == tuple(h.tok.encode("..."))
    spec_prompt = h.prompt("s1", "...")  # the decision point holds the placeholder
    spec_first = int(np.argmax(hashed_logits(spec_prompt, h.engine.info.vocab_size)))
    sink = h.serve(h.request("s1", "", max_tokens=1))
    assert sink.path == "gated"  # not exact: the positioned turn is not the request's turn
    assert sink.ids == ([spec_first] if spec_first != IM_END else [])


def test_a_placeholder_leaves_the_full_paths_token_identical(tmp_path):
    h = Harness(tmp_path, speculative_delta="...")
    open_session(h)
    h.idle()
    want = expected(h, "s1", "what now", max_tokens=5)
    sink = h.serve(h.request("s1", "what now", max_tokens=5))
    assert sink.path == "prepaid" and sink.ids == want
    h.idle()
    want = expected(h, "s1", "", max_tokens=5)
    sink = h.serve(h.request("s1", "", max_tokens=5, speculate=False))
    assert sink.path == "prepaid" and sink.ids == want
