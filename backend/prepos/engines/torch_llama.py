"""Hand-written Llama in plain torch: the default engine.

Loads a Hugging Face ``LlamaForCausalLM`` checkpoint (config.json plus
safetensors) without transformers' model classes. This module owns the
sessions: their KV, its growth and truncation, batching, and prefixes shared
between sessions (found through :mod:`prepos.engines.prefix_index`). The
forward passes are :mod:`prepos.engines.llama_forward`'s: prefill runs a block
of new tokens causally against a session's cached prefix; decode is the
one-token hot path. The packed weights and the matrix products over them (on
the CPU kernels where they can be built) are
:mod:`prepos.engines.llama_products`'s.

Numerics: float32 logits agree with transformers' float32 ones to ~1e-4 absolute
on a 135M model (float32 rounding; both are that close to a float64 reference).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch

from prepos.engines.base import (Engine, EngineInfo, KVCapacityError, check_decode_batch, check_prefill_batch,
                                 common_prefix_length)
from prepos.engines.llama_forward import LlamaForward
from prepos.engines.llama_products import LlamaProducts
from prepos.engines.llama_weights import DTYPES, read_config
from prepos.engines.prefix_index import SHARED_MIN_TOKENS, Donor, PrefixIndex, listing_points

log = logging.getLogger(__name__)


@dataclass
class _Session:
    kv: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim]
    ids: list[int] = field(default_factory=list)
    listed: list[int] = field(default_factory=list)  # the prefix hashes it is listed under as a donor


class TorchLlamaEngine(Engine):
    """Llama-architecture engine with per-session preallocated KV.

    Each session owns one KV tensor ``[layers, 2, kv_heads, capacity, head_dim]``
    whose capacity is a multiple of ``kv_block_tokens``; growing copies into a
    larger tensor, by at least an eighth of the capacity (a short session holds
    at most one block it does not use, a long one is copied once per eighth of
    its length); ``truncate`` frees whole blocks past the kept tokens.
    ``num_computed_tokens`` counts tokens run through the model (prefill and
    decode) since construction. ``num_threads`` sets torch's process-wide
    intra-op thread count. ``dtype`` is the weights' and KV's; logits are float32.
    On CPU, ``host_arena`` puts the packed weights in one block of memory on
    transparent huge pages (:mod:`prepos.engines.host_arena`); off, each is an
    ordinary torch allocation. On CPU in float32, ``cpu_kernels`` runs the decode
    GEMVs and attention through :mod:`prepos.engines.cpu_kernels` (every matrix
    then packed in 32-column blocks) where those can be built, else torch's ops.

    With ``share_prefixes``, a prefill (and :meth:`share_prefix`) copies the KV of the longest prefix its
    tokens share with another session's KV, past what the session's own KV holds, instead of computing it:
    sessions that open with the same system prompt or tool list compute it once. Sessions are listed under
    hashes of their prefixes (at 16 tokens and every 64); ``num_shared_tokens`` counts the tokens copied. Up to
    ``kept_prefixes`` closed sessions' openings stay behind as donors (:meth:`keep_prefix`), the least recently
    copied dropped first.
    """

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        num_threads: int | None = None,
        kv_block_tokens: int = 64,
        host_arena: bool = True,
        cpu_kernels: bool = True,
        share_prefixes: bool = True,
        kept_prefixes: int = 0,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if kv_block_tokens <= 0:
            raise ValueError("kv_block_tokens must be positive")
        if kept_prefixes < 0:
            raise ValueError(f"kept_prefixes must be >= 0, got {kept_prefixes}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        cfg = read_config(model_dir)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            # cuDNN's attention builds a plan per new shape (hundreds of ms): every new delta length would pay
            # it. Flash and memory-efficient attention need none. (Process-wide, like torch's own switch.)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dtype = DTYPES[dtype]
        self.kv_block_tokens = kv_block_tokens
        self.num_computed_tokens = 0
        self.share_prefixes = share_prefixes
        self.num_shared_tokens = 0
        self._sessions: dict[str | tuple[str, int], _Session] = {}  # sessions, and kept prefixes by their keys
        self._prefixes = PrefixIndex(self._sessions)  # the donors of shared prefixes
        self.kept_prefixes = kept_prefixes
        self._kept: dict[tuple[str, int], None] = {}  # kept prefixes' keys in _sessions, least recently copied first
        self._kept_keys = itertools.count()
        self.n_layers = cfg["num_hidden_layers"]
        self.hidden = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv_heads = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cfg.get("head_dim") or self.hidden // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{model_dir}: {self.n_heads} heads do not group over {self.n_kv_heads} kv heads")
        self.group = self.n_heads // self.n_kv_heads  # query heads per kv head
        self.intermediate = cfg["intermediate_size"]
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.vocab_size = cfg["vocab_size"]
        max_context = cfg.get("max_position_embeddings", 2048)
        self.products = LlamaProducts(
            model_dir, num_layers=self.n_layers, hidden=self.hidden, heads=self.n_heads, kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, intermediate=self.intermediate, eps=self.eps,
            tie=cfg.get("tie_word_embeddings", False), device=self.device, dtype=self.dtype,
            cpu_kernels=cpu_kernels, host_arena=host_arena,
        )
        self._forward = LlamaForward(
            self.products, num_layers=self.n_layers, heads=self.n_heads, kv_heads=self.n_kv_heads,
            head_dim=self.head_dim, intermediate=self.intermediate, rope_theta=cfg["rope_theta"],
            max_context=max_context, device=self.device, dtype=self.dtype,
        )
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.info = EngineInfo(
            name="torch",
            vocab_size=self.vocab_size,
            max_context=max_context,
            kv_bytes_per_token=self.n_layers * 2 * self.n_kv_heads * self.head_dim * elem,
            weight_bytes=self.products.weight_bytes,
            device=str(self.device),
        )
        log.info("loaded %s: %d layers, %.1f MB weights read per decode step, on %s/%s",
                 model_dir, self.n_layers, self.info.weight_bytes / 1e6, device, dtype)

    # ---- KV management -------------------------------------------------------------------

    def _ensure_capacity(self, s: _Session, n_tokens: int) -> None:
        for _ in self._grow_steps(s, n_tokens):
            pass

    def _grow_steps(self, s: _Session, n_tokens: int) -> Generator[None, None, None]:
        """Grow the session's KV to hold ``n_tokens`` (and at least an eighth more than it has, in whole blocks):
        a new tensor, the tokens it holds copied a layer per step; it becomes the session's KV after the last
        layer, unless the KV changed meanwhile (then the copy is dropped)."""
        cap = s.kv.shape[3]
        if n_tokens <= cap:
            return
        blocks = -(-max(n_tokens, cap + cap // 8) // self.kv_block_tokens)
        kv = torch.empty(self._kv_shape(blocks * self.kv_block_tokens), dtype=self.dtype, device=self.device)
        old, n = s.kv, len(s.ids)
        for layer in range(self.n_layers):
            kv[layer, :, :, :n] = old[layer, :, :, :n]
            yield
        if s.kv is old and len(s.ids) == n:
            s.kv = kv

    @torch.inference_mode()
    def reserve_steps(self, session_id: str, num_tokens: int) -> Generator[None, None, None]:
        s = self._sessions.get(session_id)
        if s is not None:
            yield from self._grow_steps(s, min(num_tokens, self.info.max_context))

    def _kv_shape(self, capacity: int) -> tuple[int, ...]:
        return (self.n_layers, 2, self.n_kv_heads, capacity, self.head_dim)

    def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            s = _Session(torch.empty(self._kv_shape(0), dtype=self.dtype, device=self.device))
            self._sessions[session_id] = s
        return s

    def cached_token_ids(self, session_id: str) -> Sequence[int]:
        s = self._sessions.get(session_id)
        return tuple(s.ids) if s is not None else ()

    def truncate(self, session_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens and free whole KV blocks past them.

        A ``num_tokens`` at or past the cached length keeps everything; negative raises.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        s = self._sessions.get(session_id)
        if s is None or num_tokens >= len(s.ids):
            return
        del s.ids[num_tokens:]
        self._list(session_id, s)
        cap = -(-num_tokens // self.kv_block_tokens) * self.kv_block_tokens
        if cap < s.kv.shape[3]:
            s.kv = s.kv[:, :, :, :cap].clone()

    def release(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._prefixes.unlist(session_id, s)

    def kv_bytes(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None else s.kv.numel() * s.kv.element_size()

    # ---- forward passes ------------------------------------------------------------------

    def _check_ids(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty")
        if len(ids) > self.info.max_context:
            raise ValueError(f"{len(ids)} tokens exceed max_context {self.info.max_context}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        return ids

    @torch.inference_mode()
    def prefill(self, session_id: str, token_ids: Sequence[int]) -> torch.Tensor:
        steps = self._prefill(session_id, token_ids)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def prefill_steps(self, session_id: str, token_ids: Sequence[int]) -> Generator[None, None, torch.Tensor]:
        """``prefill`` yielding after each layer. Released between steps, the session stays released."""
        return (yield from self._prefill(session_id, token_ids))

    @torch.inference_mode()
    def prefill_batch(self, session_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor | Exception]:
        """:meth:`prefill` of several distinct sessions as one forward pass: every session's new tokens go
        through each matrix product together (the weights are read once for all of them) and attend over their
        own KV. Each prefill is checked first; an impossible one gets its error and leaves its session as it
        was. One session prefills as :meth:`prefill` does."""
        w = self.products
        check_prefill_batch(session_ids, token_ids)
        if len(session_ids) == 1:
            return super().prefill_batch(session_ids, token_ids)
        results: list[torch.Tensor | Exception | None] = []
        targets = []  # (result index, session, its KV handle, kept tokens, new tokens)
        for sid, ids in zip(session_ids, token_ids):
            try:
                ids = self._check_ids(ids)
                s = self._session(sid)
                keep = common_prefix_length(s.ids, ids)
                if keep == len(ids):
                    keep -= 1  # everything cached: recompute the last token for its logits
                kv, keep = self._take(s, ids, keep)
            except (ValueError, KVCapacityError) as err:
                results.append(err)
                continue
            targets.append((len(results), s, kv, keep, ids[keep:]))
            results.append(None)  # filled below
        if len(targets) == 1:  # the others were impossible: the one-session path
            index = targets[0][0]
            try:
                results[index] = self.prefill(session_ids[index], token_ids[index])
            except (ValueError, KVCapacityError) as err:
                results[index] = err
            return results
        if targets:
            parts = [(kv, keep, torch.tensor(new, device=self.device)) for _, _, kv, keep, new in targets]
            steps = self._forward.prefill_parts(parts)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    x = done.value
                    break
            ends = torch.tensor([len(new) for *_, new in targets], device=self.device).cumsum(0) - 1
            h = w.final_norm(x[ends])
            rows = w.rows_mm(w.lm_head, h).float().unbind(0)  # [batch, vocab]
            for (index, s, _, _, new), row in zip(targets, rows):
                s.ids.extend(new)
                self._list(session_ids[index], s)
                results[index] = row
                self.num_computed_tokens += len(new)
        return results

    def _prefill(self, session_id: str, token_ids: Sequence[int]) -> Generator[None, None, torch.Tensor]:
        ids = self._check_ids(token_ids)
        s = self._session(session_id)
        keep = common_prefix_length(s.ids, ids)
        if keep == len(ids):
            keep -= 1  # everything cached: recompute the last token for its logits
        # The ids shrink before the first yield, so a generator closed part-way leaves a consistent prefix, and so
        # do its listings: it is not a donor of tokens it no longer holds (until the end relists it).
        held = keep
        kv, keep = self._take(s, ids, keep)
        self._prefixes.unlist(session_id, s, listing_points(held))
        new = ids[keep:]
        logits = yield from self._forward.prefill(kv, keep, torch.tensor(new, device=self.device))
        if self._sessions.get(session_id) is s:
            if not self._still_reserved(s, kv) or len(s.ids) != keep:
                raise RuntimeError(f"session {session_id!r} was changed while its prefill was under way")
            s.ids.extend(new)
            self._list(session_id, s)
        self.num_computed_tokens += len(new)
        return logits

    # ---- prefixes shared across sessions ---------------------------------------------------

    @torch.inference_mode()
    def share_prefix(self, session_id: str, token_ids: Sequence[int]) -> int:
        """The contract's; it also makes room for all of ``token_ids`` in the session's KV, so that a
        pre-positioning that prefills them chunk by chunk grows it once, not at every chunk that passes its
        capacity (each growth a copy of the whole KV: 6% of the time of 2,000 tokens in chunks of 32 here)."""
        s = self._sessions.get(session_id)
        keep = common_prefix_length(s.ids, token_ids) if s is not None else 0
        try:
            ids = self._check_ids(token_ids)
        except ValueError:  # the prefill of these ids reports what is wrong with them
            return keep
        s = self._session(session_id)
        if self._donor(s, ids, keep) is None:
            self.reserve(session_id, len(ids))
            return keep
        try:
            _, shared = self._take(s, ids, keep)  # looked up again: making room may drop a kept prefix
        except KVCapacityError:  # no room: the prefill that follows reports it
            return keep
        self._list(session_id, s)
        return shared

    def keep_prefix(self, session_id: str, num_tokens: int) -> bool:
        """Release the session but keep the KV of its first ``num_tokens`` tokens (as many of them as it holds:
        a one-turn session's last answer token never went through the model) as a donor for later sessions'
        prefills (a closed session's system turn), while fewer than ``kept_prefixes`` are kept (past that the
        least recently copied one goes). Not kept, only released: sharing off, fewer tokens than a donor is
        listed by, or another session or kept prefix holds all of them already. A kept prefix that the new one
        extends is dropped."""
        s = self._sessions.get(session_id)
        if s is None:
            return False
        ids = s.ids[:num_tokens]
        if (not self.share_prefixes or not self.kept_prefixes or len(ids) < SHARED_MIN_TOKENS
                or ((held := self._donor(s, ids, 0, limit=len(ids))) is not None and held.num_tokens == len(ids))):
            self.release(session_id)
            return False
        for key in [k for k in self._kept if common_prefix_length(self._sessions[k].ids, ids) == len(self._sessions[k].ids)]:
            self._drop_kept(key)
        self._prefixes.unlist(session_id, s)
        key = ("kept", next(self._kept_keys))  # no session id is a tuple
        self._sessions[key] = self._sessions.pop(session_id)
        self.truncate(key, len(ids))  # the blocks past it go
        self._list(key, s)
        self._kept[key] = None
        while len(self._kept) > self.kept_prefixes:
            self.drop_kept_prefix()
        return True

    def drop_kept_prefix(self) -> bool:
        """Release the least recently copied kept prefix; False when none is kept."""
        key = next(iter(self._kept), None)
        if key is None:
            return False
        self._drop_kept(key)
        return True

    def kept_prefix_bytes(self) -> int:
        return sum(self.kv_bytes(key) for key in self._kept)

    def _drop_kept(self, key: tuple[str, int]) -> None:
        del self._kept[key]
        self.release(key)

    def _take(self, s, ids: list[int], keep: int) -> tuple[object, int]:
        """Make the session's KV ready for a prefill of ``ids``, of which it holds the first ``keep``: room for all
        of them, and the KV of the longest prefix of ``ids`` that another session holds past ``keep`` copied in.
        Returns the handle the forward pass's prefill writes through and how many leading tokens of ``ids`` the session
        holds now. Without room, raises :class:`KVCapacityError` and changes nothing."""
        self._ensure_capacity(s, len(ids))
        kv = s.kv
        del s.ids[keep:]
        donor = self._donor(s, ids, keep)
        if donor is None:
            return kv, keep
        shared = donor.num_tokens
        kv[:, :, :, keep:shared] = donor.holder.kv[:, :, :, keep:shared]
        s.ids.extend(ids[keep:shared])
        self.num_shared_tokens += shared - keep
        return kv, shared

    def _donor(self, s, ids: list[int], keep: int, limit: int | None = None) -> Donor | None:
        """The session or kept prefix other than ``s`` whose KV holds the longest prefix of ``ids`` longer than
        ``keep``, of at most ``limit`` tokens (default: short of the last token, which a prefill computes for its
        logits); None with sharing off or none found. A kept prefix found becomes the most recently copied."""
        if not self.share_prefixes:
            return None
        donor = self._prefixes.longest(s, ids, keep, len(ids) - 1 if limit is None else limit)
        if donor is not None and donor.key in self._kept:
            self._kept[donor.key] = self._kept.pop(donor.key)
        return donor

    def _list(self, key, s) -> None:
        """List the session (or kept prefix) as a donor, as its KV holds it now."""
        if self.share_prefixes:
            self._prefixes.list(key, s)

    def _still_reserved(self, s: _Session, kv: torch.Tensor) -> bool:
        """Whether ``kv`` (from ``_take``) is still the session's KV: nothing truncated or regrew it since."""
        return s.kv is kv

    def _decode_target(self, session_id: str, token_id: int):
        """The session, token and position a decode writes; ``ValueError`` naming what makes it impossible."""
        s = self._sessions.get(session_id)
        if s is None:
            raise ValueError(f"session {session_id!r} has no KV; prefill it first")
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} not in [0, {self.vocab_size})")
        pos = len(s.ids)
        if pos >= self.info.max_context:
            raise ValueError(f"session {session_id!r} is at max_context {self.info.max_context}")
        return s, token_id, pos

    @torch.inference_mode()
    def decode(self, session_id: str, token_id: int) -> torch.Tensor:
        s, token_id, pos = self._decode_target(session_id, token_id)
        if pos >= s.kv.shape[3]:
            self._ensure_capacity(s, pos + 1)
        logits = self._forward.decode(s.kv, pos, token_id)
        s.ids.append(token_id)
        self.num_computed_tokens += 1
        return logits

    @torch.inference_mode()
    def decode_batch(self, session_ids: Sequence[str], token_ids: Sequence[int]) -> list[torch.Tensor | Exception]:
        """One decode step of several sessions: their rows go through every matrix product together (the
        weights are read once for the batch), and each attends over its own KV. Each step is checked first;
        an impossible one gets its error and leaves its session as it was. One session decodes as
        :meth:`decode` does."""
        check_decode_batch(session_ids, token_ids)
        results: list[torch.Tensor | Exception | None] = []
        targets = []  # (result index, session, token, position) of the possible steps
        for sid, tok in zip(session_ids, token_ids):
            try:
                s, tok, pos = self._batch_target(sid, tok)
            except (ValueError, KVCapacityError) as err:
                results.append(err)
                continue
            targets.append((len(results), s, tok, pos))
            results.append(None)  # filled below
        rows = self._batch_rows([(s, tok, pos) for _, s, tok, pos in targets]) if targets else []
        for (index, s, tok, _), row in zip(targets, rows):
            s.ids.append(tok)
            results[index] = row
        self.num_computed_tokens += len(targets)
        return results

    def _batch_target(self, session_id: str, token_id: int):
        """The session, token and position of a batch's step, its KV room made; the error that makes it impossible."""
        s, token_id, pos = self._decode_target(session_id, token_id)
        if pos >= s.kv.shape[3]:
            self._ensure_capacity(s, pos + 1)
        return s, token_id, pos

    def _batch_rows(self, steps: list) -> list[torch.Tensor]:
        """Logits of the possible steps ``(session, token, position)`` of a batch (one session: the one-token
        forward)."""
        if len(steps) == 1:
            s, tok, pos = steps[0]
            return [self._forward.decode(s.kv, pos, tok)]
        return list(self._forward.decode_batch([(s.kv, pos, tok) for s, tok, pos in steps]).unbind(0))
