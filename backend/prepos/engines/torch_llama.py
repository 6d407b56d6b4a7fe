"""Hand-written Llama forward in plain torch: the default engine.

Loads a Hugging Face ``LlamaForCausalLM`` checkpoint (config.json plus
safetensors) without transformers' model classes. Prefill and decode are
separate functions: prefill runs a block of new tokens causally against a
session's cached prefix; decode is the one-token hot path, written to keep
Python and kernel-launch overhead small next to the weight reads that bound it.

The packed weights and the matrix products over them (on the CPU kernels where
they can be built) are :mod:`prepos.engines.llama_products`'s; sessions' shared
prefixes are found through :mod:`prepos.engines.prefix_index`.

Numerics: float32 logits agree with transformers' float32 ones to ~1e-4 absolute
on a 135M model (float32 rounding; both are that close to a float64 reference).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Generator, Sequence

import torch
import torch.nn.functional as F

from prepos.engines.base import (Engine, EngineInfo, KVCapacityError, check_decode_batch, check_prefill_batch,
                                 common_prefix_length)
from prepos.engines import cpu_kernels as kernels_lib
from prepos.engines.llama_products import LlamaProducts
from prepos.engines.llama_weights import DTYPES, read_config, rope_tables
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
        self._build_rope(cfg["rope_theta"], max_context)
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

    # ---- loading -------------------------------------------------------------------------

    def _build_rope(self, theta: float, max_context: int) -> None:
        hd, half = self.head_dim, self.head_dim // 2
        self.cos, self.sin_signed = rope_tables(theta, hd, max_context, self.device, self.dtype)  # [max_context, hd]
        # Decode applies RoPE at one position as x @ R with R = diag(cos) + roll_matrix * sin_signed:
        # built once per step, then one matmul per layer instead of three elementwise ops.
        self._eye = torch.eye(hd, device=self.device, dtype=self.dtype)
        self._roll = torch.eye(hd, device=self.device, dtype=self.dtype).roll(half, 1)  # x @ roll == x.roll(half)

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
            steps = self._prefill_parts(parts)
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
        logits = yield from self._prefill_forward(kv, keep, torch.tensor(new, device=self.device))
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
        Returns the handle ``_prefill_forward`` writes through and how many leading tokens of ``ids`` the session
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

    def _store_kv(self, kv: torch.Tensor, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[seq, KV, hd]`` at positions ``start..`` of ``layer``."""
        end = start + k.shape[0]
        kv[layer, 0, :, start:end] = k.transpose(0, 1)
        kv[layer, 1, :, start:end] = v.transpose(0, 1)

    def _load_kv(self, kv: torch.Tensor, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..end-1`` of ``layer``, each ``[1, KV, end, hd]``."""
        return kv[layer, 0, None, :, :end], kv[layer, 1, None, :, :end]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Prefill attention: ``q [1, H, seq, hd]`` over ``k``/``v`` ``[1, KV, end, hd]``, query i at position
        ``end - seq + i`` seeing keys up to it (``mask``, or plain causal when there is no prefix)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.group > 1)

    def _prefill_forward(
        self, kv: torch.Tensor, start: int, tokens: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """Run ``tokens`` at positions ``start..`` causally over ``kv[:, :, :, :start]``; write their KV.

        Yields after each layer; returns float32 logits ``[vocab]`` of the last token only.
        """
        x = yield from self._prefill_parts([(kv, start, tokens)])
        return self.products.logits(x[-1])  # [vocab]: last position only

    def _prefill_parts(
        self, parts: Sequence[tuple[torch.Tensor, int, torch.Tensor]]
    ) -> Generator[None, None, torch.Tensor]:
        """Prefill several distinct sessions at once: part ``(kv, start, tokens)`` runs its tokens at positions
        ``start..`` causally over its own ``kv[:, :, :, :start]`` and writes their KV. The parts' rows go through
        every matrix product together (the weights are read once for all); attention is per part.

        Yields after each layer; returns the residual stream ``[sum of lengths, hidden]`` after the last layer,
        the parts' rows one after another.
        """
        w = self.products
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        inter = self.intermediate
        lengths = [tokens.shape[0] for _, _, tokens in parts]
        offsets = [sum(lengths[:j]) for j in range(len(parts))]
        n = sum(lengths)
        if len(parts) == 1:
            _, start, _ = parts[0]
            cos = self.cos[start:start + n, None, :]  # [seq, 1, hd]
            sin = self.sin_signed[start:start + n, None, :]
            tokens = parts[0][2]
        else:
            positions = torch.cat([torch.arange(start, start + m, device=self.device)
                                   for (_, start, _), m in zip(parts, lengths)])
            cos, sin = self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]
            tokens = torch.cat([tokens for _, _, tokens in parts])
        # Query i (position start+i) sees keys 0..start+i. SDPA's is_causal aligns to the top-left,
        # which is only right without a prefix, so a prefix needs the explicit offset mask.
        plans = []  # per part: (kernel attention, its mask)
        for (kv, start, _), m in zip(parts, lengths):
            kernel = w.kernel_prefill_attention and kv.is_contiguous()
            if start and not kernel:
                pos = torch.arange(start + m, device=self.device)
                plans.append((False, pos[None, :] <= pos[start:, None]))  # [seq, start+seq]
            else:
                plans.append((kernel, None))
        longest = max(start + m for (_, start, _), m in zip(parts, lengths))
        # Every layer's transposed keys, for the CPU attention kernel.
        scratch = kernels_lib.prefill_scratch(KV, hd, longest) if any(k for k, _ in plans) else None
        x = w.embedding(tokens)  # [seq, hidden]
        for i in range(self.n_layers):
            qkv = w.rows_mm(w.wqkv[i], x, norm=True).view(n, H + 2 * KV, hd)  # [seq, H+2KV, hd]
            qk = qkv[:, : H + KV]  # [seq, H+KV, hd]: RoPE q and k in one go
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)
            outs = []
            for (kv, start, _), m, o, (kernel, mask) in zip(parts, lengths, offsets, plans):
                qk_p = qk[o:o + m]
                self._store_kv(kv, i, start, qk_p[:, H:], qkv[o:o + m, H + KV:])  # [seq, KV, hd] each
                if kernel:  # [seq, H*hd], each token's heads side by side
                    outs.append(w.kernels.prefill_attend_unchecked(
                        qk_p, (H + KV) * hd, kv[i, 0].data_ptr(), kv[i, 1].data_ptr(), KV, self.group, hd, m,
                        start, kv.shape[3] * hd, scratch))
                else:
                    q = qk_p[:, :H].transpose(0, 1).unsqueeze(0)  # q: [1, H, seq, hd]
                    k, v = self._load_kv(kv, i, start + m)  # [1, KV, start+seq, hd]
                    # 4-D inputs keep SDPA on its CPU flash kernel (3-D ones take the slow math path).
                    outs.append(self._attend(q, k, v, mask)[0].transpose(0, 1).reshape(m, H * hd))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = w.rows_mm(w.wo[i], a, residual=x)
            gu = w.rows_mm(w.wgu[i], x, norm=True)  # [seq, 2*inter]
            x = w.rows_mm(w.wdown[i], F.silu(gu[:, :inter]) * gu[:, inter:], residual=x)
            yield
        return x

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
        logits = self._decode_forward(s.kv, pos, token_id)
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
            return [self._decode_forward(s.kv, pos, tok)]
        return list(self._decode_batch_forward([(s.kv, pos, tok) for s, tok, pos in steps]).unbind(0))

    def _decode_batch_forward(self, steps: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
        """Steps ``(kv, pos, token)`` of distinct sessions: each token at its ``pos`` over its own ``kv``;
        writes their KV; float32 logits ``[batch, vocab]``. The matrix products take the batch's rows
        together, as prefill takes a prompt's (the CPU GEMM kernel where the weights were packed for it)."""
        w = self.products
        tokens = torch.tensor([tok for _, _, tok in steps], device=self.device)
        if w.decode_layers is not None and all(kv.is_contiguous() for kv, _, _ in steps):
            # Every layer of every session's token in one kernel call.
            x = w.decode_layers.batch(w.embedding(tokens).contiguous(), [kv for kv, _, _ in steps],
                                          [pos for _, pos, _ in steps], self.cos, self.sin_signed)
            return w.rows_mm(w.lm_head, w.final_norm(x)).float()
        H, KV, hd, G = self.n_heads, self.n_kv_heads, self.head_dim, self.group
        n, inter = len(steps), self.intermediate
        positions = torch.tensor([pos for _, pos, _ in steps], device=self.device)
        cos, sin = self.cos[positions][:, None, :], self.sin_signed[positions][:, None, :]  # [n, 1, hd]
        # Per session, made once per step: its new KV slots in every layer, and where the attention reads.
        k_new = [kv[:, 0, :, pos] for kv, pos, _ in steps]  # n x [layers, KV, hd]
        v_new = [kv[:, 1, :, pos] for kv, pos, _ in steps]
        kernel = w.kernel_attention and all(kv.is_contiguous() for kv, _, _ in steps)
        if kernel:  # layer i's K at base + i * layer bytes, its V half a layer on
            reads = [(kv.data_ptr(), 2 * KV * kv.shape[3] * hd * kv.element_size(), kv.shape[3] * hd, pos + 1)
                     for kv, pos, _ in steps]
        x = w.embedding(tokens)  # [n, hidden]
        for i in range(self.n_layers):
            qkv = w.rows_mm(w.wqkv[i], x, norm=True).view(n, H + 2 * KV, hd)
            qk = torch.addcmul(qkv[:, : H + KV] * cos, qkv[:, : H + KV].roll(hd // 2, -1), sin)  # RoPE
            q = qk[:, :H]  # [n, H, hd], contiguous rows
            for b in range(n):
                k_new[b][i].copy_(qk[b, H:])
                v_new[b][i].copy_(qkv[b, H + KV:])
            if kernel:
                a = torch.stack([w.kernels.attend_unchecked(q[b], base + i * layer, base + i * layer + layer // 2,
                                                                KV, G, hd, keys, head)
                                 for b, (base, layer, head, keys) in enumerate(reads)])
            else:  # [1, KV, G, hd] over [1, KV, pos + 1, hd]: GQA with every cached key visible
                a = torch.stack([F.scaled_dot_product_attention(q[b].reshape(1, KV, G, hd),
                                                                kv[i, 0, None, :, : pos + 1],
                                                                kv[i, 1, None, :, : pos + 1]).reshape(-1)
                                 for b, (kv, pos, _) in enumerate(steps)])
            x = w.rows_mm(w.wo[i], a.reshape(n, H * hd), residual=x)
            gu = w.rows_mm(w.wgu[i], x, norm=True)  # [n, 2*inter]
            x = w.rows_mm(w.wdown[i], F.silu(gu[:, :inter]) * gu[:, inter:], residual=x)
        h = w.final_norm(x)
        return w.rows_mm(w.lm_head, h).float()  # [n, vocab]

    def _decode_forward(self, kv: torch.Tensor, pos: int, token_id: int) -> torch.Tensor:
        """One token at ``pos`` over ``kv[:, :, :, :pos]``; writes its KV; returns float32 logits ``[vocab]``.

        Activations stay 1-D and every step costs a fixed, small number of ops per layer: the
        weights' read time is the floor, everything else is overhead. Each matmul is one call:
        the CPU GEMV kernel, or a ``bmm`` over the packed chunks (residual adds fused in as
        baddbmm's input, the norm as its alpha). Attention is the CPU kernel's, or SDPA's. Query heads are
        grouped per kv head as ``[1, KV, G, hd]`` so SDPA sees G query rows per kv head with
        every cached key visible: GQA without repeating KV or a mask.
        """
        w = self.products
        if w.decode_layers is not None and kv.is_contiguous():
            # All layers in one kernel call: no Python or dispatch between the weight reads.
            x = w.decode_layers(w.embedding(token_id).contiguous(), kv, self.cos[pos], self.sin_signed[pos], pos)
            return w.logits(x)
        H, KV, hd, G = self.n_heads, self.n_kv_heads, self.head_dim, self.group
        inter, qk_width, end = self.intermediate, (H + KV) * hd, pos + 1
        norm_mm, add_mm, sdpa, mm = w.norm_mm, w.add_mm, F.scaled_dot_product_attention, torch.mm
        rot = torch.addcmul(self._eye * self.cos[pos], self._roll, self.sin_signed[pos])  # [hd, hd]
        # Per-layer views, made once per step: this position's KV slots and the keys/values so far.
        k_new, v_new = kv[:, 0, :, pos].unbind(0), kv[:, 1, :, pos].unbind(0)  # layers x [KV, hd]
        k_all, v_all = kv[:, 0, None, :, :end].unbind(0), kv[:, 1, None, :, :end].unbind(0)  # layers x [1, KV, end, hd]
        attend = w.kernels.attend_unchecked if w.kernel_attention and kv.is_contiguous() else None
        if attend is not None:  # the kernel takes raw addresses: layer i's K at base + i * layer, its V half a layer on
            cap = kv.shape[3]
            base, layer, head = kv.data_ptr(), 2 * KV * cap * hd * kv.element_size(), cap * hd
        x = w.embedding(token_id).contiguous()  # [hidden]
        for i, (wqkv, wo, wgu, wdown) in enumerate(w.layers):
            qkv = norm_mm(wqkv, x)  # [(H+2KV)*hd]
            qk = mm(qkv[:qk_width].view(H + KV, hd), rot)  # [H+KV, hd], RoPE applied
            k_new[i].copy_(qk[H:])
            v_new[i].copy_(qkv[qk_width:].view(KV, hd))
            if attend is not None:
                a = attend(qk[:H], base + i * layer, base + i * layer + layer // 2, KV, G, hd, end, head)  # [H*hd]
            else:
                # 4-D inputs: SDPA's CPU flash kernel; 3-D ones fall back to the slower math path.
                a = sdpa(qk[:H].view(1, KV, G, hd), k_all[i], v_all[i]).reshape(-1)  # [H*hd]
            x = add_mm(wo, a, x)  # [hidden]
            gu = norm_mm(wgu, x)  # [2*inter]
            act = F.silu(gu[:inter]).mul_(gu[inter:])  # [inter]
            x = add_mm(wdown, act, x)
        return w.logits(x)
