"""The model's packed weights and the products over them, for :class:`~prepos.engines.torch_llama.TorchLlamaEngine`.

The checkpoint is read and packed by :mod:`prepos.engines.llama_weights`
(fused q/k/v and gate/up matrices with the RMSNorm weights folded in, stored
in column blocks). On CPU in float32 the products run on the GEMV/GEMM
kernels of :mod:`prepos.engines.cpu_kernels` where those can be built (every
matrix then packed in their 32-column blocks), else on torch's ops; the
engine's attention takes the kernels too where they fit (``kernel_attention``,
``kernel_prefill_attention``), and a decode runs every layer in one kernel call
where ``decode_layers`` is set.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from prepos.engines import cpu_kernels as kernels_lib
from prepos.engines.host_arena import huge_page_bytes, thp_mode
from prepos.engines.llama_weights import pack_weights

log = logging.getLogger("prepos.engines.torch_llama")


class LlamaProducts:
    """Packed weights (``embed``, ``lm_head``, ``ln_final``, per layer ``wqkv``, ``wo``, ``wgu``, ``wdown``) and
    the matrix products a forward pass takes through them."""

    def __init__(
        self,
        model_dir: str,
        *,
        num_layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        tie: bool,
        device: torch.device,
        dtype: torch.dtype,
        cpu_kernels: bool,
        host_arena: bool,
    ) -> None:
        self.hidden, self.eps = hidden, eps
        self.n_eps = hidden * eps
        group = heads // kv_heads
        cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        self.kernels = kernels_lib.load() if cpu_kernels and cpu_fp32 else None
        self.kernel_attention = self.kernels is not None and kernels_lib.attention_fits(group, head_dim)
        self.kernel_prefill_attention = self.kernel_attention and kernels_lib.prefill_attention_fits(head_dim)
        log.info("matrix products: %s; decode attention: %s; prefill attention: %s",
                 f"prepos CPU kernels ({self.kernels.path})" if self.kernels else "torch matmul",
                 *("prepos CPU kernels" if on else "torch SDPA"
                   for on in (self.kernel_attention, self.kernel_prefill_attention)))
        packed = pack_weights(model_dir, num_layers=num_layers, hidden=hidden, tie=tie, device=device,
                              dtype=dtype, kernel_block=kernels_lib.BLOCK if self.kernels else None,
                              host_arena=host_arena)
        self.embed, self.lm_head, self.ln_final = packed.embed, packed.lm_head, packed.ln_final
        self.wqkv, self.wo, self.wgu, self.wdown = packed.wqkv, packed.wo, packed.wgu, packed.wdown
        self.decode_layers = None
        if self.kernel_attention:
            try:
                self.decode_layers = kernels_lib.DecodeLayers(
                    self.kernels, self.wqkv, self.wo, self.wgu, self.wdown, heads=heads,
                    kv_heads=kv_heads, head_dim=head_dim, inter=intermediate, n_eps=self.n_eps)
            except ValueError as e:
                log.info("decode layers: one kernel call per op (%s)", e)
        if packed.arena is not None:
            huge = huge_page_bytes(self.lm_head)
            log.info("weights in one %.1f MB host arena; %s MB on huge pages (transparent huge pages: %s)",
                     packed.arena.num_bytes / 1e6, "unknown" if huge is None else f"{huge / 1e6:.1f}", thp_mode())
        self.layers = list(zip(self.wqkv, self.wo, self.wgu, self.wdown))
        # Inputs that bmm's beta=0 never reads, shaped like the outputs of the norm-fed matrices.
        self._zeros = {w.shape: torch.zeros(w.shape[0], 1, w.shape[2], device=device, dtype=dtype)
                       for w in (self.wqkv[0], self.wgu[0])}
        self.cpu = device.type == "cpu"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (every matrix, the final norm; not the embedding)."""
        read = [*self.wqkv, *self.wo, *self.wgu, *self.wdown, self.ln_final, self.lm_head]
        return sum(t.numel() * t.element_size() for t in read)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last RMSNorm, before the LM head."""
        return F.rms_norm(x, (self.hidden,), self.ln_final, self.eps)

    def embedding(self, tokens: torch.Tensor | int) -> torch.Tensor:
        """Embedding rows ``[..., hidden]`` of ``tokens`` (a tied embedding is lm_head's columns)."""
        if self.embed is not None:
            return self.embed[tokens]
        block = self.lm_head.shape[2]
        return self.lm_head[tokens // block, :, tokens % block]

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [seq, in]`` times a packed ``[c, in, out/c]`` matrix -> ``[seq, out]``."""
        if w.shape[0] == 1:
            return torch.mm(x, w[0])
        return torch.matmul(x, w).transpose(0, 1).reshape(x.shape[0], -1)  # [c, seq, out/c] -> [seq, out]

    def rows_mm(self, w: torch.Tensor, x: torch.Tensor, *, norm: bool = False,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x [seq, in]`` (each row RMS-normed first with ``norm``; the norm's weight is folded into ``w``) times
        packed ``w``, plus ``residual [seq, out]`` when given: prefill's products, on the CPU GEMM kernel where
        ``w`` was packed for it."""
        if self.on_gemv_kernel(w):
            x = x.contiguous()
            scale = torch.rsqrt(x.pow(2).sum(-1).add_(self.n_eps)) if norm else None
            return self.kernels.gemm_unchecked(w, x, scale, None if residual is None else residual.contiguous())
        y = self.mm(self.rms_scale(x) if norm else x, w)
        return y if residual is None else residual + y

    def rms_scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times ``rsqrt(sum(x^2) + hidden*eps)`` per row, i.e. RMSNorm without its weight and
        without the 1/sqrt(hidden) factor: both live in the matrix the norm feeds."""
        xf = x.float()  # sums of squares overflow float16; a no-op for float32
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True).add_(self.n_eps))).to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[vocab]`` of the residual stream ``x [hidden]`` after the last layer."""
        h = self.final_norm(x)
        if self.on_gemv_kernel(self.lm_head):
            return self.kernels.gemv_unchecked(self.lm_head, h, 1.0, None)
        c = self.lm_head.shape[0]
        return torch.bmm(h.expand(c, 1, -1), self.lm_head).view(-1).float()

    def on_gemv_kernel(self, w: torch.Tensor) -> bool:
        """Whether packed ``w`` is multiplied by the CPU GEMV kernel (it was packed in its 32-column blocks)."""
        return self.kernels is not None and w.shape[2] == kernels_lib.BLOCK

    def add_mm(self, w: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x + v @ w`` for 1-D contiguous ``v`` and ``x`` and packed ``w``."""
        if self.on_gemv_kernel(w):
            return self.kernels.gemv_unchecked(w, v, 1.0, x)
        c = w.shape[0]
        return torch.baddbmm(x.view(c, 1, -1), v.expand(c, 1, -1), w).view(-1)

    def norm_mm(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``rmsnorm(x) @ w`` for 1-D ``x`` and packed ``w`` (the norm's weight folded into it)."""
        xf = x.float()  # sums of squares overflow float16; a no-op for float32
        c = w.shape[0]
        if self.cpu:
            # Reading a scalar back costs nothing on CPU, and baddbmm's alpha then applies the
            # norm without another op (beta=0: the zeros input is never read).
            r = (torch.dot(xf, xf).item() + self.n_eps) ** -0.5
            if self.on_gemv_kernel(w):
                return self.kernels.gemv_unchecked(w, x, r, None)
            return torch.baddbmm(self._zeros[w.shape], x.expand(c, 1, -1), w, beta=0, alpha=r).view(-1)
        h = (xf * torch.rsqrt(torch.dot(xf, xf) + self.n_eps)).to(x.dtype)
        return torch.bmm(h.expand(c, 1, -1), w).view(-1)
