"""The Llama forward passes of :class:`~prepos.engines.torch_llama.TorchLlamaEngine`, over KV it owns.

:class:`LlamaForward` runs tokens through the model: a prefill of several
sessions' new tokens at once (each over its own cached prefix), a decode step of
several sessions, and the one-token decode, the hot path, written to keep Python
and kernel-launch overhead small next to the weight reads that bound it. It holds
the packed weights and their products (:mod:`prepos.engines.llama_products`) and
the RoPE tables, and no session state: the engine hands it each session's KV
handle, and a :class:`KVAccess` (:class:`DenseKV`, or the paged engine's) says
how a prefill writes and reads that KV.
"""

from __future__ import annotations

from typing import Generator, Protocol, Sequence

import torch
import torch.nn.functional as F

from prepos.engines import cpu_kernels as kernels_lib
from prepos.engines.llama_products import LlamaProducts
from prepos.engines.llama_weights import rope_tables


class KVAccess(Protocol):
    """How a prefill writes and reads a session's KV through the handle its engine gave it."""

    def store_kv(self, kv: object, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def load_kv(self, kv: object, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor: ...


class DenseKV:
    """A session's KV as one tensor ``[layers, 2, kv_heads, capacity, head_dim]`` (the handle is the tensor)."""

    def __init__(self, group: int) -> None:
        self.group = group  # query heads per kv head

    def store_kv(self, kv: torch.Tensor, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[seq, KV, hd]`` at positions ``start..`` of ``layer``."""
        end = start + k.shape[0]
        kv[layer, 0, :, start:end] = k.transpose(0, 1)
        kv[layer, 1, :, start:end] = v.transpose(0, 1)

    def load_kv(self, kv: torch.Tensor, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..end-1`` of ``layer``, each ``[1, KV, end, hd]``."""
        return kv[layer, 0, None, :, :end], kv[layer, 1, None, :, :end]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Prefill attention: ``q [1, H, seq, hd]`` over ``k``/``v`` ``[1, KV, end, hd]``, query i at position
        ``end - seq + i`` seeing keys up to it (``mask``, or plain causal when there is no prefix)."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=self.group > 1)


class LlamaForward:
    """The forward passes; ``kv_access`` is how prefills reach the KV (the decode passes take dense KV)."""

    def __init__(
        self,
        products: LlamaProducts,
        *,
        num_layers: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        rope_theta: float,
        max_context: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.products = products
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = num_layers, heads, kv_heads, head_dim
        self.group = heads // kv_heads  # query heads per kv head
        self.intermediate = intermediate
        self.device = device
        self.kv_access: KVAccess = DenseKV(self.group)
        hd, half = head_dim, head_dim // 2
        self.cos, self.sin_signed = rope_tables(rope_theta, hd, max_context, device, dtype)  # [max_context, hd]
        # Decode applies RoPE at one position as x @ R with R = diag(cos) + roll_matrix * sin_signed:
        # built once per step, then one matmul per layer instead of three elementwise ops.
        self._eye = torch.eye(hd, device=device, dtype=dtype)
        self._roll = torch.eye(hd, device=device, dtype=dtype).roll(half, 1)  # x @ roll == x.roll(half)

    def prefill(
        self, kv: torch.Tensor, start: int, tokens: torch.Tensor
    ) -> Generator[None, None, torch.Tensor]:
        """Run ``tokens`` at positions ``start..`` causally over ``kv[:, :, :, :start]``; write their KV.

        Yields after each layer; returns float32 logits ``[vocab]`` of the last token only.
        """
        x = yield from self.prefill_parts([(kv, start, tokens)])
        return self.products.logits(x[-1])  # [vocab]: last position only

    def prefill_parts(
        self, parts: Sequence[tuple[object, int, torch.Tensor]]
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
                self.kv_access.store_kv(kv, i, start, qk_p[:, H:], qkv[o:o + m, H + KV:])  # [seq, KV, hd] each
                if kernel:  # [seq, H*hd], each token's heads side by side
                    outs.append(w.kernels.prefill_attend_unchecked(
                        qk_p, (H + KV) * hd, kv[i, 0].data_ptr(), kv[i, 1].data_ptr(), KV, self.group, hd, m,
                        start, kv.shape[3] * hd, scratch))
                else:
                    q = qk_p[:, :H].transpose(0, 1).unsqueeze(0)  # q: [1, H, seq, hd]
                    k, v = self.kv_access.load_kv(kv, i, start + m)  # [1, KV, start+seq, hd]
                    # 4-D inputs keep SDPA on its CPU flash kernel (3-D ones take the slow math path).
                    outs.append(self.kv_access.attend(q, k, v, mask)[0].transpose(0, 1).reshape(m, H * hd))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = w.rows_mm(w.wo[i], a, residual=x)
            gu = w.rows_mm(w.wgu[i], x, norm=True)  # [seq, 2*inter]
            x = w.rows_mm(w.wdown[i], F.silu(gu[:, :inter]) * gu[:, inter:], residual=x)
            yield
        return x

    def decode_batch(self, steps: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
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

    def decode(self, kv: torch.Tensor, pos: int, token_id: int) -> torch.Tensor:
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
