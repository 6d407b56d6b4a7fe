"""The scan kernel's source (OpenAI Triton), for ``prepos.scan_triton``, which compiles it or interprets it.

Triton picks compiled or interpreted execution from ``TRITON_INTERPRET`` when
it is first imported: with ``TRITON_INTERPRET=1`` in the environment before
that, this kernel runs on CPU tensors under Triton's interpreter (NumPy).
Importing this module needs Triton installed.
"""

import triton
import triton.language as tl


@triton.jit
def vocab_scan(logits_ptr, row_stride, ids_ptr, n, part_ptr, ticket_ptr, out_ptr, num_parts,
               HAS_IDS: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    part = tl.program_id(0)
    row = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    offs = part * BLOCK + lane
    valid = offs < n
    if HAS_IDS:
        ids = tl.load(ids_ptr + offs, mask=valid, other=0)
        x = tl.load(logits_ptr + row * row_stride + ids, mask=valid, other=-float("inf")).to(tl.float32)
    else:
        x = tl.load(logits_ptr + row * row_stride + offs, mask=valid, other=-float("inf")).to(tl.float32)
    m = tl.max(x, 0)
    first = tl.argmax(x, 0, tie_break_left=True)
    second = tl.max(tl.where(lane == first, -float("inf"), x), 0)
    finite = x > -float("inf")
    d = tl.where(finite, x - tl.where(m > -float("inf"), m, 0.0), 0.0)  # a part may hold no finite logit
    e = tl.where(finite, tl.exp(d), 0.0)
    # A NaN logit fails every comparison, so it would pass as masked: it makes the part's sum NaN instead, and
    # with it the row's p_max, which the host refuses.
    s = tl.sum(e, 0) + tl.where(tl.sum((x != x).to(tl.int32), 0) > 0, float("nan"), 0.0)
    t = tl.sum(e * d, 0)
    rec = part_ptr + (row * num_parts + part) * 5
    tl.store(rec + 0, m)
    tl.store(rec + 1, s)
    tl.store(rec + 2, t)
    tl.store(rec + 3, second)
    tl.store(rec + 4, (part * BLOCK + first).to(tl.float32))  # exact: positions are below 2**24
    # The release half of the ticket publishes this part's record; the last program acquires all of them.
    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
    if ticket == num_parts - 1:
        j = tl.arange(0, PARTS)
        jm = j < num_parts
        base = part_ptr + (row * num_parts + j) * 5
        mi = tl.load(base + 0, mask=jm, other=-float("inf"), cache_modifier=".cg")
        si = tl.load(base + 1, mask=jm, other=0.0, cache_modifier=".cg")
        ti = tl.load(base + 2, mask=jm, other=0.0, cache_modifier=".cg")
        seci = tl.load(base + 3, mask=jm, other=-float("inf"), cache_modifier=".cg")
        fi = tl.load(base + 4, mask=jm, other=0.0, cache_modifier=".cg")
        big = tl.max(mi, 0)
        live = mi > -float("inf")
        shift = tl.where(live, mi - tl.where(big > -float("inf"), big, 0.0), 0.0)
        w = tl.where(live, tl.exp(shift), 0.0)
        total = tl.sum(w * si, 0)
        tsum = tl.sum(w * (ti + si * shift), 0)
        win = tl.argmax(mi, 0, tie_break_left=True)  # parts are in position order: the first maximum
        pos = tl.sum(tl.where(j == win, fi, 0.0), 0)
        runner = tl.maximum(tl.max(tl.where(j == win, -float("inf"), mi), 0),
                            tl.max(tl.where(j == win, seci, -float("inf")), 0))
        res = out_ptr + row * 5
        tl.store(res + 0, pos)
        tl.store(res + 1, 1.0 / total)
        tl.store(res + 2, tl.exp(runner - big) / total)
        tl.store(res + 3, tl.log(total) - tsum / total)
        tl.store(res + 4, big)
        tl.store(ticket_ptr + row, 0)  # ready for the next launch
