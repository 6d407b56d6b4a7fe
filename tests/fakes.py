"""Toy-size stand-ins for unit tests: a character tokenizer, ChatML framing and a fake engine.

The fake engine's logits are a pure function of the whole token sequence, so a
stateless full prefill and any incremental path must agree token for token;
what the tests check is the scheduler's bookkeeping, not a model.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from prepos.engines.base import Engine, EngineInfo, common_prefix_length
from prepos.protocol import ProtocolError, ResponseChunk
from prepos.template import Framing
from prepos.template import Tokenizer as PreposTokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
IM_START, IM_END = 0, 1


def write_char_tokenizer(path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path))
    return path


def char_tokenizer(tmp_path: Path) -> PreposTokenizer:
    return PreposTokenizer(write_char_tokenizer(tmp_path / "tokenizer.json"))


def chatml_ids(tok: PreposTokenizer, text: str) -> tuple[int, ...]:
    """``text`` with ChatML's special tokens as themselves (``tok.encode`` reads them as plain text)."""
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, SPECIALS)) + ")", text):
        ids.extend([VOCAB[piece]] if piece in SPECIALS else tok.encode(piece) if piece else [])
    return tuple(ids)


def chatml_framing(tok: PreposTokenizer) -> Framing:
    def enc(text: str) -> tuple[int, ...]:
        return chatml_ids(tok, text)

    return Framing(
        entry_ids={role: tuple(enc(f"<|im_start|>{role}\n")) for role in ("system", "user", "tool")},
        close_ids=tuple(enc("<|im_end|>\n")),
        cue_ids=tuple(enc("<|im_end|>\n<|im_start|>assistant\n")),
        answer_terminator_ids=tuple(enc("<|im_end|>\n")),
        default_system_ids=tuple(enc("<|im_start|>system\nBe brief.<|im_end|>\n")),
        stop_token_ids=frozenset({IM_END}),
    )


def write_engine_dir(path: Path) -> Path:
    """An engine directory (tokenizer + prepos_engine.json) for the fake engine."""
    path.mkdir(parents=True, exist_ok=True)
    tok = PreposTokenizer(write_char_tokenizer(path / "tokenizer.json"))
    framing = chatml_framing(tok)
    manifest = {
        "format_version": 1, "model_name": "fake", "vocab_size": len(VOCAB), "max_context": 4096,
        "framing": {
            "roles": {r: {"entry_ids": list(v)} for r, v in framing.entry_ids.items()},
            "close_ids": list(framing.close_ids), "cue_ids": list(framing.cue_ids),
            "answer_terminator_ids": list(framing.answer_terminator_ids),
            "default_system_ids": list(framing.default_system_ids), "stop_token_ids": sorted(framing.stop_token_ids),
        },
    }
    (path / "prepos_engine.json").write_text(json.dumps(manifest))
    return path


def write_tiny_llama(path, *, tie: bool, max_context: int = 256):
    """A tiny random Llama checkpoint (2 layers, vocabulary 512) at ``path``; returns the transformers model. Its
    weights are widened past the default initialization's, whose near-uniform logits would let mismatches hide
    in noise (and greedy choices sit on near-ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                         tie_word_embeddings=tie)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def hashed_logits(seq: Sequence[int], vocab: int) -> np.ndarray:
    """Pseudo-random logits determined by the last 8 tokens and the length; ends answers now and then."""
    digest = hashlib.blake2b(np.asarray(seq[-8:], dtype=np.int64).tobytes() + len(seq).to_bytes(4, "little")).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    logits = rng.normal(0.0, 2.0, vocab).astype(np.float32)
    logits[IM_START] = -30.0
    logits[IM_END] += 2.0
    return logits


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeEngine(Engine):
    """Engine contract over a pure function of the sequence. Every computed token advances the fake clock."""

    def __init__(self, vocab: int = len(VOCAB), max_context: int = 4096, clock: FakeClock | None = None,
                 token_time_s: float = 0.001, step_time_s: float = 0.005,
                 logits_fn: Callable[[Sequence[int], int], np.ndarray] = hashed_logits, num_layers: int = 0,
                 share_prefixes: bool = False, by_reference: bool = False):
        self.info = EngineInfo("fake", vocab, max_context, kv_bytes_per_token=100, weight_bytes=1000, device="cpu")
        self.clock = clock or FakeClock()
        self.token_time_s, self.step_time_s = token_time_s, step_time_s
        self.logits_fn = logits_fn
        self.num_layers = num_layers  # > 0: prefill_steps yields once per layer
        self.kv: dict = {}
        self.calls: list[tuple[str, object, int]] = []  # (method, session, tokens computed)
        self.on_compute: Callable[[], None] | None = None  # called mid-computation (tests inject arrivals here)
        self.batches: list[tuple] = []  # the sessions of each decode_batch call
        self.prefill_batches: list[tuple] = []  # the sessions of each prefill_batch call
        self.share_prefixes = share_prefixes  # share_prefix copies what another session holds, as the torch engine
        self.num_shared_tokens = 0
        self.kept: list[tuple[str, int]] = []  # kept prefixes' keys in kv, least recently kept first
        self.room: dict = {}  # session -> tokens its KV has room for (reserve), counted in kv_bytes
        # KV held by reference, as the paged engine's pages (here whole tokens): a prefix several sessions or kept
        # prefixes hold counts once in kv_total_bytes, and releasing one frees only what no other holds; no room
        self.by_reference = by_reference

    def _compute(self, session_id, seq: list[int], num_new: int) -> torch.Tensor:
        self.clock.t += self.step_time_s + self.token_time_s * num_new / 2
        if self.on_compute is not None:
            self.on_compute()
        self.clock.t += self.token_time_s * num_new / 2
        self.kv[session_id] = list(seq)
        return torch.from_numpy(self.logits_fn(seq, self.info.vocab_size))

    def prefill(self, session_id, token_ids):
        if not token_ids or len(token_ids) > self.info.max_context:
            raise ValueError("bad length")
        cached = self.kv.get(session_id, [])
        reuse = min(common_prefix_length(cached, token_ids), len(token_ids) - 1)
        self.calls.append(("prefill", session_id, len(token_ids) - reuse))
        return self._compute(session_id, list(token_ids), len(token_ids) - reuse)

    def prefill_steps(self, session_id, token_ids):
        if not self.num_layers:
            return self.prefill(session_id, token_ids)
        cached = self.kv.get(session_id, [])
        num_new = len(token_ids) - min(common_prefix_length(cached, token_ids), len(token_ids) - 1)
        for layer in range(self.num_layers):
            self.clock.t += self.token_time_s * num_new / self.num_layers / 2
            if self.on_compute is not None:
                self.on_compute()
            self.clock.t += self.token_time_s * num_new / self.num_layers / 2
            yield
        self.calls.append(("prefill", session_id, num_new))
        self.kv[session_id] = list(token_ids)
        return torch.from_numpy(self.logits_fn(list(token_ids), self.info.vocab_size))

    def prefill_batch(self, session_ids, token_ids):
        self.prefill_batches.append(tuple(session_ids))
        return super().prefill_batch(session_ids, token_ids)

    def decode_batch(self, session_ids, token_ids):
        self.batches.append(tuple(session_ids))
        return super().decode_batch(session_ids, token_ids)

    def decode(self, session_id, token_id):
        if len(self.kv[session_id]) >= self.info.max_context:  # as the real engines: the KV has no room left
            raise ValueError(f"session {session_id!r} is at max_context {self.info.max_context}")
        self.calls.append(("decode", session_id, 1))
        return self._compute(session_id, self.kv[session_id] + [token_id], 1)

    def share_prefix(self, session_id, token_ids):
        held = common_prefix_length(self.kv.get(session_id, []), token_ids)
        if not self.share_prefixes:
            return held
        shared = max((min(common_prefix_length(kv, token_ids), len(token_ids) - 1)
                      for sid, kv in self.kv.items() if sid != session_id), default=0)
        if shared <= held:
            return held
        self.kv[session_id] = list(token_ids[:shared])
        self.num_shared_tokens += shared - held
        return shared

    def keep_prefix(self, session_id, num_tokens):
        ids = self.kv.pop(session_id, None)
        if not self.share_prefixes or not ids:
            return False
        key = ("kept", len(self.kept) and self.kept[-1][1] + 1)
        self.kv[key] = ids[:num_tokens]  # as much of the opening as its KV holds
        self.kept.append(key)
        return True

    def kept_prefix_bytes(self):
        return sum(self.kv_bytes(key) for key in self.kept)

    def drop_kept_prefix(self):
        if not self.kept:
            return False
        del self.kv[self.kept.pop(0)]
        return True

    def cached_token_ids(self, session_id):
        return tuple(self.kv.get(session_id, ()))

    def truncate(self, session_id, num_tokens):
        self.kv[session_id] = self.kv.get(session_id, [])[:num_tokens]
        self.room.pop(session_id, None)  # as the torch engine, whose truncate gives the room back

    def release(self, session_id):
        self.kv.pop(session_id, None)
        self.room.pop(session_id, None)

    def reserve_steps(self, session_id, num_tokens):
        yield  # a step, as the torch engine's copy of a layer
        if session_id in self.kv and not self.by_reference:
            self.room[session_id] = max(self.room.get(session_id, 0), min(num_tokens, self.info.max_context))

    def kv_bytes(self, session_id):
        if session_id not in self.kv:
            return 0
        return 100 * max(len(self.kv[session_id]), self.room.get(session_id, 0))

    def kv_total_bytes(self):
        if not self.by_reference:
            return None
        total, previous = 0, ()
        for seq in sorted({tuple(ids) for ids in self.kv.values()}):  # the distinct prefixes of them all
            total += len(seq) - common_prefix_length(previous, seq)
            previous = seq
        return 100 * total

    def kv_release_bytes(self, session_id):
        if not self.by_reference or session_id not in self.kv:
            return self.kv_bytes(session_id)
        ids = self.kv[session_id]
        held = max((common_prefix_length(ids, other) for key, other in self.kv.items() if key != session_id),
                   default=0)
        return 100 * (len(ids) - held)


class CollectSink:
    """Records what a request got back."""

    def __init__(self) -> None:
        self.chunks: list[ResponseChunk] = []
        self.error: ProtocolError | None = None
        self.finals = 0
        self.client_gone = False  # tests set it to act as a client that cancelled

    def send(self, chunk: ResponseChunk, final: bool) -> None:
        assert self.finals == 0, "response after the final one"
        self.chunks.append(chunk)
        self.finals += final

    def send_error(self, error: ProtocolError) -> None:
        assert self.finals == 0, "error after the final response"
        self.error = error
        self.finals += 1

    def cancelled(self) -> bool:
        return self.client_gone

    @property
    def done(self) -> bool:
        return self.finals == 1

    @property
    def ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def path(self) -> str:
        return self.chunks[0].path
