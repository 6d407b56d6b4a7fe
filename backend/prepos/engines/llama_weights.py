"""A Llama checkpoint read and packed for the torch engines' forward passes.

Reads a Hugging Face ``LlamaForCausalLM`` checkpoint (config.json plus
safetensors, one file or indexed shards) without transformers' model classes.

Layout: the q/k/v projections are fused into one matrix and gate/up into
another, so a layer issues four matmuls, and each RMSNorm weight is folded into
the matrix it feeds. A matrix is stored as ``[chunks, in, out/chunks]``: column
blocks, each contiguous. A decode GEMV is then one ``bmm`` whose batch is the
chunks, which torch spreads over its threads; a plain ``mv`` keeps one core
streaming and reads weights ~25% slower on a 2-core CPU. On CPU the chunk count
follows the output width (:func:`cpu_chunks`): wide matrices get one chunk per
thread, narrow ones 32-column chunks, the shape MKL's batched small GEMV reads
fastest (``loadtest/chunking_bench.py``: on a 2-core EPYC, SmolLM2-135M's q/k/v,
o and down matrices read at 11-16 GB/s in 2 chunks and at 20-38 GB/s in 32-column
ones, and a decode step took 12-22% less). Where the CPU kernels run, every
matrix is packed in their 32-column blocks. Elsewhere a matrix is one chunk. The
embedding of tied checkpoints is read out of the lm_head's chunks, so that
matrix is held once.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from prepos.engines.host_arena import HostArena

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(model_dir: str) -> dict:
    """The checkpoint's config.json, checked for what the torch engines run: a plain-RoPE, bias-free, SiLU Llama.
    ``rope_theta`` is filled in from wherever this transformers version wrote it."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise ValueError(f"{model_dir}: architectures {archs} is not LlamaForCausalLM")
    rope_params = cfg.get("rope_parameters") or {}
    for scaling in (cfg.get("rope_scaling"), rope_params):
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if scaling and kind != "default":
            raise ValueError(f"{model_dir}: rope scaling {scaling!r} is not supported (only plain RoPE)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{model_dir}: projection biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_dir}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    cfg["rope_theta"] = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return cfg


def load_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """All checkpoint tensors, from one ``model.safetensors`` or an indexed set of shards."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(os.path.join(model_dir, shard)))
    return tensors


def cpu_chunks(out: int, threads: int) -> int:
    """Column blocks of a CPU matrix with ``out`` outputs: one per thread where each block is at least 1024
    columns wide, else 32-column blocks when they split evenly over the threads, else one per thread; a
    single block on one thread or where the threads do not divide ``out``."""
    if threads < 2 or out % threads:
        return 1
    narrow = out // 32
    if out // threads < 1024 and out % 32 == 0 and narrow % threads == 0:
        return narrow
    return threads


@dataclass
class PackedWeights:
    """The matrices a forward pass reads, each packed ``[chunks, in, out/chunks]`` with its norm folded in."""

    embed: torch.Tensor | None  # [vocab, hidden]; None when tied (the embedding is read out of lm_head)
    wqkv: list[torch.Tensor]  # per layer: q, k, v projections, input norm folded in
    wo: list[torch.Tensor]
    wgu: list[torch.Tensor]  # per layer: gate and up projections, post-attention norm folded in
    wdown: list[torch.Tensor]
    lm_head: torch.Tensor  # [chunks, hidden, vocab/chunks]
    ln_final: torch.Tensor  # [hidden], applied as an RMSNorm weight (not folded)
    arena: HostArena | None  # the host memory they live in, where one was used


def pack_weights(model_dir: str, *, num_layers: int, hidden: int, tie: bool, device: torch.device,
                 dtype: torch.dtype, kernel_block: int | None, host_arena: bool) -> PackedWeights:
    """Read the checkpoint and pack it for ``device``/``dtype``: in ``kernel_block``-column blocks where that
    divides a matrix (the CPU kernels'), else in :func:`cpu_chunks` on CPU and whole on other devices; on CPU
    with ``host_arena``, all in one :class:`HostArena`. An untied config without ``lm_head.weight`` is read as
    tied (logged)."""
    sd = load_tensors(model_dir)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    if not tie and "lm_head.weight" not in sd:
        log.warning("%s: untied config but no lm_head.weight; using the embedding", model_dir)
        tie = True
    # Each packed matrix: the checkpoint tensors stacked along outputs, and the RMSNorm weight folded
    # into its rows (times sqrt(hidden): the forward scales a token by 1/sqrt(sum of squares + hidden*eps)),
    # so a norm is one scale factor per token.
    specs: list[tuple[tuple[str, ...], str | None]] = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        specs += [(tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv"), p + "input_layernorm.weight"),
                  ((p + "self_attn.o_proj.weight",), None),
                  ((p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), p + "post_attention_layernorm.weight"),
                  ((p + "mlp.down_proj.weight",), None)]
    specs.append((("model.embed_tokens.weight" if tie else "lm_head.weight",), None))
    arena = None
    if device.type == "cpu" and host_arena:
        elem = torch.empty((), dtype=dtype).element_size()
        arena = HostArena(HostArena.size_for([sum(sd[n].numel() for n in names) * elem for names, _ in specs]))
    root_n = float(hidden) ** 0.5

    def pack(names: tuple[str, ...], norm: str | None) -> torch.Tensor:
        w = torch.cat([sd.pop(n).float() for n in names], 0)  # [out, in]
        if norm is not None:
            w = w * (sd.pop(norm).float() * root_n)[None, :]
        out, d_in = w.shape
        c = out // kernel_block if kernel_block and out % kernel_block == 0 else cpu_chunks(out, threads)
        # [out, in] -> [c, in, out/c]: block j holds outputs j*out/c.., so a flat view of the
        # bmm result [c, 1, out/c] is the output vector in order
        blocks = w.view(c, out // c, d_in).transpose(1, 2)
        if arena is None:
            return blocks.contiguous().to(device=device, dtype=dtype)
        return arena.take(blocks.shape, dtype).copy_(blocks)

    # Untied: the embedding is kept [vocab, hidden] for row gathers and never read whole (popped
    # before packing; a tied one is popped by the lm_head's pack).
    embed = None if tie else sd.pop("model.embed_tokens.weight").to(device=device, dtype=dtype)
    packed = [pack(names, norm) for names, norm in specs]
    L = num_layers
    wqkv, wo, wgu, wdown = (packed[k : 4 * L : 4] for k in range(4))
    ln_final = sd.pop("model.norm.weight").to(device=device, dtype=dtype)
    sd.pop("lm_head.weight", None)
    if sd:
        log.warning("%s: ignoring unexpected tensors %s", model_dir, sorted(sd)[:5])
    return PackedWeights(embed, wqkv, wo, wgu, wdown, packed[-1], ln_final, arena)


def rope_tables(theta: float, head_dim: int, max_context: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos`` and signed ``sin`` tables, each ``[max_context, head_dim]``: ``rotate_half(x) * sin`` is
    ``x.roll(head_dim // 2, -1) * sin_signed`` (the negation folded into the table). Built with transformers'
    float32 recipe for its default RoPE, so that logits match it closely."""
    hd = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    freqs = torch.arange(max_context, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_context, hd]
    sin = emb.sin()
    sin[:, : hd // 2].neg_()
    return emb.cos().to(device, dtype), sin.to(device, dtype)
