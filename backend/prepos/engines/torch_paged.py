"""The torch engine on CUDA: a static, paged KV pool and a decode step captured once as a CUDA graph.

On a GPU the plain torch engine's decode is launch-bound: a few hundred small
kernels per token, each a few microseconds of host time, for a step whose
weight reads take well under a millisecond. This engine removes that overhead:

- **Static KV.** One pool ``[layers, 2, pages * PAGE, KV, hd]`` is allocated at
  start; a session owns a list of pages (``page_tokens`` positions each) and
  frees them on truncate/release. Addresses never move, so a graph can hold them.
- **Captured, batched decode.** A decode step takes the tokens of up to
  ``max_batch`` sessions as the rows of one batch: the weights are read once for
  all of them. Each row reads its token, position, write slot and its session's
  block table from one small device buffer (``meta``, a row per session) and the
  decode attention runs as an OpenAI Triton kernel over the pool
  (``prepos._attention_kernel``), so one CUDA graph per batch size (1, 2, 4, ...,
  captured on first use; a step is padded to the next size) serves every session
  at every length. A step is then one host-to-device copy of ``meta``, one graph
  replay and one copy of the logits out of the graph's buffer (they must outlive
  the next step).
- **The distribution stays on the device**; the server's scan of it runs on the
  GPU (``prepos.scan_triton``, ``engine.scan = auto``).

Prefill is eager (it is one large batch of tokens): its K/V are written into
the session's pages and attention reads the session's positions gathered from
the pool. A prefix another session holds (``share_prefixes``) is shared by
reference: the session's block table points at that session's whole pages
(a count per page says how many tables hold it), and only the rows of a last,
partly filled page are copied. Nobody writes a page another table holds: a
session about to write into one (its KV diverges inside it, or it was
truncated into it) first gets a page of its own with the rows before the
write copied (copy on write). A page goes back to the free list when no table
holds it. Page 0 is scratch (the graph's capture writes there) and never
belongs to a session.

Off CUDA (tests), the same code runs without a graph, the kernel under Triton's
interpreter (``TRITON_INTERPRET=1``): that checks the paging and the kernel
against the stateless forward on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from prepos.engines.base import KVCapacityError
from prepos.engines.llama_forward import DenseKV
from prepos.engines.torch_llama import TorchLlamaEngine

log = logging.getLogger(__name__)


@dataclass
class _PagedSession:
    pages: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    listed: list[int] = field(default_factory=list)  # the prefix hashes it is listed under as a donor
    epoch: int = 0  # bumped when pages are freed, so a prefill under way can tell


class KVPoolExhausted(KVCapacityError):
    """No free KV page for a session's new tokens; the message gives the pool's size."""


class PagedKV(DenseKV):
    """How a prefill reaches the pool: the handle is ``(session, epoch, slots)``, ``slots`` the flat pool row of
    each of the session's positions."""

    def __init__(self, pool: torch.Tensor, group: int) -> None:
        super().__init__(group)
        self.pool = pool  # [layers, 2, pages * PAGE, KV, hd]

    def store_kv(self, kv, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = kv[2][start:start + k.shape[0]]
        self.pool[layer, 0].index_copy_(0, rows, k)
        self.pool[layer, 1].index_copy_(0, rows, v)

    def load_kv(self, kv, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = kv[2][:end]
        k = self.pool[layer, 0].index_select(0, rows)  # [end, KV, hd]
        v = self.pool[layer, 1].index_select(0, rows)
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def attend(self, q, k, v, mask):
        if self.pool.device.type != "cuda":
            return super().attend(q, k, v, mask)
        # On CUDA: kv heads repeated for the query heads and the causal offset as a lower-right causal bias,
        # so SDPA runs flash or memory-efficient attention (no explicit mask, no per-shape plan).
        seq, end = q.shape[2], k.shape[2]
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(seq, end))


class PagedTorchLlamaEngine(TorchLlamaEngine):
    """:class:`TorchLlamaEngine` over a paged KV pool, decode captured as a CUDA graph on CUDA devices.

    ``kv_pool_bytes`` sizes the pool (0: half the device memory free after the
    weights on CUDA, 256 MiB elsewhere). ``page_tokens`` and ``splits`` (pages
    walked in parallel by the decode attention) must be powers of two. ``max_batch``
    is the most sessions one decode step takes; a graph is captured, on first use,
    for each batch size of 1, 2, 4, ... up to it (a step is padded to the next one).
    """

    def __init__(self, model_dir: str, *, device: str = "cuda", dtype: str = "float32",
                 num_threads: int | None = None, kv_pool_bytes: int = 0, page_tokens: int = 64,
                 splits: int = 32, cuda_graph: bool | None = None, max_batch: int = 32,
                 share_prefixes: bool = True, kept_prefixes: int = 0) -> None:
        for name, value in (("page_tokens", page_tokens), ("splits", splits)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if not 1 <= max_batch <= 1024:
            raise ValueError(f"max_batch must be in [1, 1024], got {max_batch}")
        try:
            import triton

            from prepos import _attention_kernel
            from prepos.scan_triton import triton_interprets
        except ImportError as exc:
            raise RuntimeError(f"the paged torch engine needs OpenAI Triton ({exc})") from None
        if triton_interprets(triton) != (torch.device(device).type == "cpu"):
            raise ValueError(f"the decode attention kernel runs on CUDA, or on CPU under Triton's interpreter "
                             f"(TRITON_INTERPRET=1 before Triton is imported); not on {device} in this process")
        # Its decode and attention are the Triton kernels', on CUDA (or interpreted): not the CPU kernels.
        super().__init__(model_dir, device=device, dtype=dtype, num_threads=num_threads,
                         kv_block_tokens=page_tokens, cpu_kernels=False, share_prefixes=share_prefixes,
                         kept_prefixes=kept_prefixes)
        if self.head_dim & (self.head_dim - 1):
            raise ValueError(f"{model_dir}: head_dim {self.head_dim} is not a power of two (the decode kernel's)")
        self._paged_kernels = _attention_kernel
        self._inv_root_n = torch.full((self.hidden,), self.hidden ** -0.5, dtype=self.dtype, device=self.device)
        self.page_tokens, self.splits = page_tokens, splits
        page_bytes = self.info.kv_bytes_per_token * page_tokens
        if not kv_pool_bytes:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_pool_bytes = free // 2
            else:
                kv_pool_bytes = 256 << 20
        n_pages = kv_pool_bytes // page_bytes
        if n_pages < 2:
            raise ValueError(f"kv_pool_bytes {kv_pool_bytes} holds fewer than 2 pages of {page_bytes} bytes")
        self.num_pages = n_pages
        # pool[layer, 0 or 1]: [pages * PAGE, KV, hd], one flat row per (position, kv head)
        self.pool = torch.zeros(self.n_layers, 2, n_pages * page_tokens, self.n_kv_heads, self.head_dim,
                                dtype=self.dtype, device=self.device)
        self._forward.kv_access = PagedKV(self.pool, self.group)
        self._free = list(range(n_pages - 1, 0, -1))  # page 0 is scratch; pop() hands out low pages first
        self._holders = [0] * n_pages  # per page, how many block tables (sessions, kept prefixes) hold it
        self._page_bytes = page_bytes
        self.kv_capacity_bytes = (n_pages - 1) * page_bytes
        self._max_pages = -(-self.info.max_context // page_tokens)
        # decode step inputs, one row per session of the step: token, position, flat slot of the position,
        # block table
        self.max_batch = max_batch
        self._batch_sizes = sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})
        self._meta = torch.zeros(max_batch, 3 + self._max_pages, dtype=torch.int32, device=self.device)
        pin = self.device.type == "cuda"
        self._meta_host = torch.zeros(max_batch, 3 + self._max_pages, dtype=torch.int32, pin_memory=pin)
        self._meta_np = self._meta_host.numpy()
        # set when the copy of the (pinned) host buffer is under way, so the next step does not overwrite it
        self._meta_copied = torch.cuda.Event() if pin else None
        H = self.n_heads
        self._part_acc = torch.empty(max_batch, splits, H, self.head_dim, dtype=torch.float32, device=self.device)
        self._part_ml = torch.empty(max_batch, splits, H, 2, dtype=torch.float32, device=self.device)
        self._attn = torch.empty(max_batch, H, self.head_dim, dtype=self.dtype, device=self.device)
        self._use_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # batch size -> graph, its logits
        self.info = dataclasses.replace(self.info, name="torch-paged")
        log.info("paged KV pool: %d pages x %d tokens (%.1f MB), decode of up to %d sessions per step %s", n_pages,
                 page_tokens, self.pool.numel() * self.pool.element_size() / 1e6, max_batch,
                 "captured as CUDA graphs" if self._use_graph else "eager")

    # ---- pages ---------------------------------------------------------------------------

    def _session(self, session_id: str) -> _PagedSession:
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = _PagedSession()
        return s

    def _own(self, s: _PagedSession, start: int, n_tokens: int) -> None:
        """Pages of the session's own for positions ``start..n_tokens-1``: a new one where it has none, or where the
        page it has is held by another table too (the rows before ``start`` copied into the new one). Kept prefixes
        give way while the pool is short; without room, :class:`KVPoolExhausted` and nothing changed."""
        P = self.page_tokens
        while True:
            todo = self._not_own(s.pages, start, n_tokens)
            if len(todo) <= len(self._free) or not self.drop_kept_prefix():  # kept prefixes give way to sessions
                break
        if len(todo) > len(self._free):
            raise KVPoolExhausted(f"KV pool exhausted: {len(todo)} more pages of {P} tokens needed, "
                                  f"{len(self._free)} of {self.num_pages - 1} free")
        for i in todo:
            page = self._free.pop()
            self._holders[page] = 1
            if i < len(s.pages):  # copy on write
                if i * P < start:
                    self._copy_rows(s.pages[i], page, 0, start - i * P)
                self._let_go([s.pages[i]])
                s.pages[i] = page
                s.epoch += 1
            else:
                s.pages.append(page)

    def _not_own(self, pages: list[int], start: int, n_tokens: int) -> list[int]:
        """The indices of the block table ``pages`` that positions ``start..n_tokens-1`` need a page of their own
        at: past its end, or where its page is held by another table too."""
        P = self.page_tokens
        return [i for i in range(start // P, -(-n_tokens // P)) if i >= len(pages) or self._holders[pages[i]] > 1]

    def _let_go(self, pages: list[int]) -> None:
        """The pages are no longer held by one table; those no table holds go back to the free list."""
        for page in reversed(pages):
            self._holders[page] -= 1
            if not self._holders[page]:
                self._free.append(page)

    def _copy_rows(self, src: int, dst: int, lo: int, hi: int) -> None:
        """Rows ``lo..hi-1`` of page ``src`` into the same rows of page ``dst``, every layer."""
        P = self.page_tokens
        self.pool[:, :, dst * P + lo: dst * P + hi] = self.pool[:, :, src * P + lo: src * P + hi]

    def reserve_steps(self, session_id: str, num_tokens: int):
        """Nothing: a session takes pages as its positions are written, and nothing moves."""
        return
        yield

    def _slots(self, s: _PagedSession, start: int, end: int) -> torch.Tensor:
        """Flat pool rows of positions ``start..end-1`` (int64, on the device)."""
        P = self.page_tokens
        pages = torch.tensor(s.pages[start // P: -(-end // P)], dtype=torch.int64)
        rows = (pages[:, None] * P + torch.arange(P)).view(-1)[start % P: start % P + end - start]
        return rows.to(self.device)

    def truncate(self, session_id: str, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        s = self._sessions.get(session_id)
        if s is None or num_tokens >= len(s.ids):
            return
        del s.ids[num_tokens:]
        self._list(session_id, s)
        keep = -(-num_tokens // self.page_tokens)
        if keep < len(s.pages):
            self._let_go(s.pages[keep:])
            del s.pages[keep:]
            s.epoch += 1

    def release(self, session_id: str) -> None:
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self._prefixes.unlist(session_id, s)
            self._let_go(s.pages)
            s.pages.clear()
            s.epoch += 1

    def kv_bytes(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None else len(s.pages) * self._page_bytes

    def kv_release_bytes(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None else sum(self._holders[page] == 1 for page in s.pages) * self._page_bytes

    def kv_total_bytes(self) -> int:
        return (self.num_pages - 1 - len(self._free)) * self._page_bytes

    # ---- prefill: the base forward, K/V through the pages ----------------------------------

    def _take(self, s: _PagedSession, ids: list[int], keep: int):
        """The base's, by reference: the donor's whole pages past the session's first ``keep // page_tokens`` go
        into its block table, the rows of a last, partly filled one are copied into a page of its own, and the
        pages it will write are its own (:meth:`_own`). All or nothing."""
        P = self.page_tokens
        while True:
            found = self._donor(s, ids, keep)
            donor, shared = (found.holder, found.num_tokens) if found is not None else (None, keep)
            whole = shared // P if donor is not None else 0  # the donor's pages below this are referenced
            pages = s.pages[:keep // P] + donor.pages[keep // P:whole] + s.pages[whole:] if whole > keep // P \
                else s.pages  # its block table once the donor's pages are in
            write = shared if donor is not None else keep
            need = len(self._not_own(pages, write, len(ids)))
            freed = sum(1 for page in s.pages[keep // P:whole] if self._holders[page] == 1)
            if need <= len(self._free) + freed or not self.drop_kept_prefix():
                break
        if need > len(self._free) + freed:
            raise KVPoolExhausted(f"KV pool exhausted: {need - freed} more pages of {P} tokens needed, "
                                  f"{len(self._free)} of {self.num_pages - 1} free")
        del s.ids[keep:]
        if whole > keep // P:
            for page in donor.pages[keep // P:whole]:
                self._holders[page] += 1
            self._let_go(s.pages[keep // P:whole])
            s.pages[keep // P:whole] = donor.pages[keep // P:whole]
            s.epoch += 1
        self._own(s, write, len(ids))
        if donor is not None:
            if shared > whole * P:  # the rows of the donor's partly shared page
                start = whole * P
                self._copy_rows(donor.pages[whole], s.pages[whole], max(keep, start) - start, shared - start)
            s.ids.extend(ids[keep:shared])
            self.num_shared_tokens += shared - keep
            keep = shared
        return (s, s.epoch, self._slots(s, 0, len(ids))), keep

    def _still_reserved(self, s: _PagedSession, kv) -> bool:
        return kv[0] is s and kv[1] == s.epoch

    def _paged_target(self, session_id: str, token_id: int):
        """The session, token and position of a decode step, with the step's page reserved; ``ValueError`` or
        :class:`KVPoolExhausted` naming what makes it impossible (the session is then unchanged)."""
        s, token_id, pos = self._decode_target(session_id, token_id)
        if not pos:
            raise ValueError(f"session {session_id!r} has no KV; prefill it first")
        self._own(s, pos, pos + 1)
        return s, token_id, pos

    @torch.inference_mode()
    def decode(self, session_id: str, token_id: int) -> torch.Tensor:
        s, token_id, pos = self._paged_target(session_id, token_id)
        logits = self._decode_rows([(s, token_id, pos)])[0]
        s.ids.append(token_id)
        self.num_computed_tokens += 1
        return logits

    # decode_batch is the base's: each step checked by _batch_target, the possible ones run by _batch_rows.
    _batch_target = _paged_target

    def _batch_rows(self, steps: list[tuple[_PagedSession, int, int]]) -> list[torch.Tensor]:
        """Up to ``max_batch`` sessions per step of the batch (more are taken ``max_batch`` at a time): the weights
        are read once for all of them and each row attends over its own pages."""
        return [row for start in range(0, len(steps), self.max_batch)
                for row in self._decode_rows(steps[start:start + self.max_batch])]

    def _decode_rows(self, steps: list[tuple[_PagedSession, int, int]]) -> list[torch.Tensor]:
        """Steps ``(session, token, position)`` of at most ``max_batch`` distinct sessions, pages reserved:
        one step of the smallest batch size that holds them (the rows past them are padding that writes and
        reads the scratch page); float32 logits ``[vocab]`` per step, on the device."""
        n = len(steps)
        b = next(size for size in self._batch_sizes if size >= n)
        if self._meta_copied is not None:
            self._meta_copied.synchronize()  # the previous step's copy of the host buffer has been made
        P, meta = self.page_tokens, self._meta_np
        for r, (s, token_id, pos) in enumerate(steps):
            meta[r, 0], meta[r, 1], meta[r, 2] = token_id, pos, s.pages[pos // P] * P + pos % P
            meta[r, 3:3 + len(s.pages)] = s.pages
        meta[n:b, :4] = 0  # padding: token 0 at position 0 of page 0
        self._meta[:b].copy_(self._meta_host[:b], non_blocking=True)
        if self._meta_copied is not None:
            self._meta_copied.record()
        if self._use_graph:
            graph, out = self._graphs.get(b) or self._capture(b)
            graph.replay()
            logits = out[:n].clone()  # the graph's buffer is the next step's too
        else:
            logits = self._decode_step(b)[:n]
        return list(logits.unbind(0))

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (compiles the Triton kernels) and capture the decode step of ``b`` rows; its scratch writes
        go to page 0."""
        saved = self._meta[:b].clone()
        self._meta[:b].zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._decode_step(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._decode_step(b)
        self._meta[:b].copy_(saved)
        self._graphs[b] = (graph, out)
        log.info("decode step of %d session(s) captured as a CUDA graph (%d layers)", b, self.n_layers)
        return graph, out

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """``_rms_scale`` as one fused RMSNorm: its weight, the constant 1/sqrt(hidden), undoes the sqrt(hidden)
        folded into the matrices with the norms' own weights."""
        return F.rms_norm(x, (self.hidden,), self._inv_root_n, self.eps)

    def _decode_step(self, b: int) -> torch.Tensor:
        """One token per row of ``self._meta[:b]`` through every layer; float32 logits ``[b, vocab]``.
        Graph-capturable: no host reads, fixed shapes."""
        H, KV, hd, G = self.n_heads, self.n_kv_heads, self.head_dim, self.group
        inter = self.intermediate
        meta = self._meta[:b].long()
        token, pos, slot = meta[:, 0], meta[:, 1], meta[:, 2]
        rope = self._forward
        cos, sin = rope.cos.index_select(0, pos)[:, None], rope.sin_signed.index_select(0, pos)[:, None]  # [b, 1, hd]
        x = self.products.embedding(token).reshape(b, self.hidden)
        scale = hd ** -0.5
        gp = 1 << (G - 1).bit_length()
        attn = self._attn[:b].view(b, H * hd)
        for i, (wqkv, wo, wgu, wdown) in enumerate(self.products.layers):
            qkv = self.products.mm(self._norm(x), wqkv).view(b, H + 2 * KV, hd)
            qk = qkv[:, : H + KV]
            qk = torch.addcmul(qk * cos, qk.roll(hd // 2, -1), sin)  # RoPE at each row's position
            self.pool[i, 0].index_copy_(0, slot, qk[:, H:])
            self.pool[i, 1].index_copy_(0, slot, qkv[:, H + KV:])
            q = qk[:, :H].contiguous()  # [b, H, hd]
            self._paged_kernels.decode_attention_splits[(KV, self.splits, b)](
                q, self.pool[i, 0], self.pool[i, 1], self._meta, self._part_acc, self._part_ml, scale,
                self._meta.stride(0), KV=KV, G=G, GP=gp, HD=hd, PAGE=self.page_tokens,
                CHUNK=min(16, self.page_tokens), SPLITS=self.splits)
            self._paged_kernels.merge_splits[(H, b)](self._part_acc, self._part_ml, self._attn, H=H, HD=hd,
                                                SPLITS=self.splits)
            x = x + self.products.mm(attn, wo)
            gu = self.products.mm(self._norm(x), wgu)  # [b, 2*inter]
            x = x + self.products.mm(F.silu(gu[:, :inter]) * gu[:, inter:], wdown)
        h = self.products.final_norm(x)
        return self.products.mm(h, self.products.lm_head).float()  # [b, vocab]
