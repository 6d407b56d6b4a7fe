"""Decode attention over a paged KV pool, in OpenAI Triton (for ``prepos.engines.torch_paged``).

One query token per batch row (each row a different session), grouped-query
heads. Each row's token position and its session's block table are read from
device memory, so one captured CUDA graph per batch size serves every session
and every length. Split-K ("flash decoding"): program ``(kv_head, split, row)``
walks the row's chunks of CHUNK positions ``split, split + SPLITS, ...`` with an
online softmax and writes a partial (max, sum, weighted values) per query head;
:func:`merge_splits` combines the partials.

Pool layout per layer and K/V: ``[pages * PAGE, KV, HD]`` (a page holds PAGE
consecutive positions of one session, all kv heads). ``meta`` is int32
``[rows, meta_stride]``, one row per batch row: token id, position, flat slot of
the position, then the block table. Like ``prepos._scan_kernel``, this module needs Triton and is run
interpreted on CPU tensors under ``TRITON_INTERPRET=1``.
"""

import triton
import triton.language as tl


@triton.jit
def decode_attention_splits(q_ptr, k_ptr, v_ptr, meta_ptr, part_acc_ptr, part_ml_ptr, scale, meta_stride,
                            KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr,
                            PAGE: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    meta_ptr += row * meta_stride
    q_ptr += row * (KV * G * HD)
    g = tl.arange(0, GP)
    d = tl.arange(0, HD)
    r = tl.arange(0, CHUNK)
    gm = g < G
    heads = kvh * G + g  # query heads of this kv head: [GP]
    q = tl.load(q_ptr + heads[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0).to(tl.float32)  # [GP, HD]
    q = q * scale
    seq_len = tl.load(meta_ptr + 1) + 1
    n_chunks = (seq_len + CHUNK - 1) // CHUNK
    m = tl.full([GP], -float("inf"), tl.float32)
    l_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    # Chunks of CHUNK positions (CHUNK divides PAGE) keep the [GP, CHUNK, HD] products in registers.
    for c in range(split, n_chunks, SPLITS):
        first = c * CHUNK
        page = tl.load(meta_ptr + 3 + first // PAGE)
        valid = first + r < seq_len  # [CHUNK]
        rows = (page * PAGE + first % PAGE + r) * KV + kvh  # [CHUNK]
        k = tl.load(k_ptr + rows[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * HD + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2)  # [GP, CHUNK]
        s = tl.where(valid[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every visited chunk holds a valid position
        alpha = tl.exp(m - m_new)
        w = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v[None, :, :], 1)
        m = m_new
    out = (row * SPLITS + split) * (KV * G) + heads  # partial record of (row, split, head)
    tl.store(part_acc_ptr + out[:, None] * HD + d[None, :], acc, mask=gm[:, None])
    tl.store(part_ml_ptr + out * 2, m, mask=gm)
    tl.store(part_ml_ptr + out * 2 + 1, l_sum, mask=gm)


@triton.jit
def merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, H: tl.constexpr, HD: tl.constexpr,
                 SPLITS: tl.constexpr):
    h = tl.program_id(0)
    row = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HD)
    rec = (row * SPLITS + s) * H + h
    m = tl.load(part_ml_ptr + rec * 2)
    l_sum = tl.load(part_ml_ptr + rec * 2 + 1)
    acc = tl.load(part_acc_ptr + rec[:, None] * HD + d[None, :])  # [SPLITS, HD]
    top = tl.max(m, 0)  # finite: split 0 always holds position 0
    live = m > -float("inf")
    w = tl.where(live, tl.exp(tl.where(live, m - top, 0.0)), 0.0)
    o = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l_sum, 0)
    tl.store(out_ptr + (row * H + h) * HD + d, o.to(out_ptr.dtype.element_ty))
