"""The tokenizer wrapper: decoding short answers from its cache gives exactly the tokenizer's own text."""

from __future__ import annotations

import random

from tokenizers import Tokenizer as HFTokenizer

from fakes import VOCAB, write_char_tokenizer
from prepos import template
from prepos.template import Tokenizer


def test_cached_decodes_equal_the_tokenizers_own(tmp_path, monkeypatch):
    path = write_char_tokenizer(tmp_path / "tokenizer.json")
    reference = HFTokenizer.from_file(str(path))
    monkeypatch.setattr(template, "_MAX_CACHED_DECODES", 5)  # small enough that the cache fills and starts over
    tok = Tokenizer(path)
    rng = random.Random(7)
    sequences = [[rng.randrange(len(VOCAB)) for _ in range(rng.randrange(0, 12))] for _ in range(40)]
    for _ in range(3):  # first decode, then (for short ones) the cached text
        for ids in sequences:
            assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False)
            assert len(tok._decoded) <= 5
    assert tok.decode((0, 5, 1)) == "<|im_start|>#<|im_end|>"  # special tokens are kept, a tuple works too
