"""The tokenizer wrapper: decoding short answers and encoding choices from its caches gives exactly the
tokenizer's own result."""

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


def test_cached_choice_ids_equal_the_tokenizers_own_and_build_the_same_trie(tmp_path, monkeypatch):
    path = write_char_tokenizer(tmp_path / "tokenizer.json")
    reference = HFTokenizer.from_file(str(path))
    monkeypatch.setattr(template, "_MAX_CACHED_CHOICES", 4)
    monkeypatch.setattr(template, "_CACHED_CHOICE_CHARS", 6)
    tok = Tokenizer(path)
    rng = random.Random(3)
    letters = "abcdefgh_"
    names = ["".join(rng.choice(letters) for _ in range(rng.randrange(1, 10))) for _ in range(12)]
    for _ in range(3):  # first encode, then (for short ones) the remembered ids; the cache fills and starts over
        for name in names:
            assert tok.encode_choice(name) == tuple(reference.encode(name, add_special_tokens=False).ids)
            assert len(tok._choice_ids) <= 4
    fresh = Tokenizer(path)
    for choices in (tuple(names[:5]), ("ab", "abc", "b"), tuple(reversed(names[:5]))):
        cached, plain = template.ChoiceTrie(choices, tok, 99), template.ChoiceTrie(choices, fresh, 99)
        assert cached.token_ids == plain.token_ids
        assert cached.forced_ids() == plain.forced_ids() and cached.allowed_ids(()) == plain.allowed_ids(())


def test_a_remembered_choice_is_not_tokenized_again(tmp_path, monkeypatch):
    tok = Tokenizer(write_char_tokenizer(tmp_path / "tokenizer.json"))
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(text) or real(text))
    template.ChoiceTrie(("get_weather", "get_time"), tok, 99)
    template.ChoiceTrie(("get_time", "get_weather", "cd"), tok, 99)
    assert calls == ["get_weather", "get_time", "cd"]
    long_name = "x" * (template._CACHED_CHOICE_CHARS + 1)
    tok.encode_choice(long_name)
    tok.encode_choice(long_name)
    assert calls[-2:] == [long_name, long_name]  # too long to keep: tokenized each time


def test_a_sole_choice_leaves_its_last_token_to_a_decision(tmp_path):
    tok = Tokenizer(write_char_tokenizer(tmp_path / "tokenizer.json"))
    sole = template.ChoiceTrie(("abc",), tok, 99)
    ids = list(tok.encode_choice("abc"))
    assert sole.forced_ids() == ids  # every token is forced ...
    assert sole.leading_ids() == ids[:-1] and sole.allowed_ids(ids[:-1]) == ids[-1:]  # ... but one is scanned
    assert sole.finished(ids) == 0
    one_token = template.ChoiceTrie(("a",), tok, 99)
    assert one_token.leading_ids() == [] and one_token.allowed_ids(()) == list(tok.encode_choice("a"))
    shared = template.ChoiceTrie(("ab", "ac"), tok, 99)
    assert shared.leading_ids() == shared.forced_ids() == list(tok.encode_choice("a"))  # stops at a real decision
