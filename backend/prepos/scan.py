"""The vocabulary scan: one pass over a next-token distribution.

Contract (every implementation): given logits ``[vocab]``, an optional set of
allowed token ids (a ``choices`` trie node), a temperature and top-k/top-p cuts
and, when sampling, one uniform draw ``u`` in [0, 1), return a
:class:`ScanResult`:

- ``p_max``, ``margin``, ``entropy``: the gate's features, over the allowed
  tokens at temperature 1 (probabilities renormalised over the allowed set;
  margin = top-1 minus top-2 probability, 0 when one token is allowed; entropy
  in nats);
- ``token_id``: greedy (temperature 0) the allowed token with the largest
  logit, lowest id on ties (whatever the order the allowed ids are listed
  in); sampling: the tempered distribution over the allowed set, cut to the ``top_k`` most likely then to the smallest
  most-likely prefix whose mass reaches ``top_p`` (order: probability
  descending, id ascending on ties), renormalised, inverted at ``u``.

Logits that hold no distribution are refused with ValueError, naming the
problem (:func:`unreadable_logits`): a NaN or +inf among the allowed tokens, or
no finite one (all ``-inf``).

``numpy`` is the reference; ``torch`` runs where the logits live (CPU or CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class ScanResult:
    token_id: int
    p_max: float
    margin: float
    entropy: float
    num_allowed: int

    @property
    def certainty(self) -> float:
        """1 - entropy / log(num_allowed): 1 when one token holds all mass, 0 when uniform."""
        if self.num_allowed <= 1:
            return 1.0
        return max(0.0, 1.0 - self.entropy / math.log(self.num_allowed))


ScanFn = Callable[..., ScanResult]

NO_FINITE_LOGIT = "scan: no finite logit among the allowed tokens"


def unreadable_logits(logits, allowed_ids=None) -> ValueError:
    """The error for logits a scan found it cannot read a distribution from, naming why: the first allowed token
    whose logit is NaN, else the first that is +inf, else that none is finite (all ``-inf``). Looked at only once
    a scan has failed, so it may copy the logits to the host."""
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().float().cpu().numpy()
    x = np.asarray(logits, dtype=np.float64)
    if allowed_ids is None:
        return _unreadable(x, np.arange(x.shape[0]))
    ids = np.asarray(allowed_ids.cpu() if isinstance(allowed_ids, torch.Tensor) else list(allowed_ids), dtype=np.int64)
    return _unreadable(x[ids], ids)


def _unreadable(values: np.ndarray, ids: Sequence[int]) -> ValueError:
    """:func:`unreadable_logits` of the allowed logits ``values`` of the tokens ``ids``."""
    for what, found in (("NaN", np.isnan(values)), ("+inf", values == np.inf)):
        if found.any():
            token = int(ids[int(np.argmax(found))])
            return ValueError(f"scan: the logit of token {token} is {what}: no distribution can be read from these "
                              "logits")
    return ValueError(NO_FINITE_LOGIT)


def allowed_id_array(allowed_ids, vocab: int) -> np.ndarray:
    """``allowed_ids`` as a sorted int64 array (ties go to the lowest id, whatever the order given). Raises
    ValueError for an empty set, an id outside ``[0, vocab)`` or one listed twice."""
    ids = np.asarray(allowed_ids.cpu() if isinstance(allowed_ids, torch.Tensor) else list(allowed_ids),
                     dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("allowed_ids: must be a non-empty list of token ids")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"allowed_ids: token ids must lie in [0, {vocab})")
    ids = np.sort(ids)
    if (ids[1:] == ids[:-1]).any():
        raise ValueError("allowed_ids: repeated token ids")
    return ids


def _cut_and_pick_numpy(q: np.ndarray, top_k: int, top_p: float, u: float) -> int:
    order = np.argsort(-q, kind="stable")  # probability descending, index ascending on ties
    sorted_q = q[order]
    if 0 < top_k < len(sorted_q):
        sorted_q = sorted_q[:top_k]
    if top_p < 1.0:
        cum = np.cumsum(sorted_q) / sorted_q.sum()
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        sorted_q = sorted_q[:keep]
    cum = np.cumsum(sorted_q)
    index = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(order[min(index, len(sorted_q) - 1)])


def scan_numpy(
    logits: np.ndarray | torch.Tensor,
    *,
    allowed_ids: Sequence[int] | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    uniform: float | None = None,
) -> ScanResult:
    """Reference implementation (float64 accumulation)."""
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().float().cpu().numpy()
    # x: [allowed]
    x = np.asarray(logits, dtype=np.float64)
    ids = None if allowed_ids is None else allowed_id_array(allowed_ids, x.shape[0])
    if ids is not None:
        x = x[ids]
    top = x.max()
    if not math.isfinite(top) or np.isnan(x).any():
        raise unreadable_logits(logits, ids)
    e = np.exp(x - top)
    total = e.sum()
    p = e / total
    order2 = np.argsort(-p, kind="stable")[:2]
    p_max = float(p[order2[0]])
    margin = float(p_max - p[order2[1]]) if len(x) > 1 else p_max
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    if temperature == 0.0:
        index = int(order2[0])
    else:
        if uniform is None:
            raise ValueError("scan: sampling needs a uniform draw")
        q = np.exp((x - top) / temperature)
        index = _cut_and_pick_numpy(q / q.sum(), top_k, top_p, uniform)
    token = int(ids[index]) if ids is not None else index
    return ScanResult(token_id=token, p_max=p_max, margin=margin, entropy=entropy, num_allowed=len(x))


def scan_torch(
    logits: torch.Tensor,
    *,
    allowed_ids: Sequence[int] | torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    uniform: float | None = None,
) -> ScanResult:
    """Torch implementation on the logits' device; one host sync at the end.

    A greedy scan over a small allowed set (a ``choices`` decision) reads those
    logits once and finishes on the host in float64: a dozen tiny tensor
    operations would cost more than the numbers they handle.
    """
    if allowed_ids is not None and temperature == 0.0 and 0 < len(allowed_ids) <= SMALL_ALLOWED_SET:
        ids = sorted(allowed_ids.tolist() if isinstance(allowed_ids, torch.Tensor) else allowed_ids)
        index = torch.as_tensor(ids, dtype=torch.long, device=logits.device)
        return _scan_small(logits.index_select(0, index).tolist(), ids)
    # x: [allowed] float32
    x = logits.float()
    ids = None
    if allowed_ids is not None:  # in id order: ties go to the lowest id
        ids = torch.as_tensor(allowed_ids, dtype=torch.long, device=x.device).sort().values
        x = x.index_select(0, ids)
    lse = torch.logsumexp(x, 0)
    p = torch.exp(x - lse)
    k = min(2, x.numel())
    top_p2, top_i2 = torch.topk(p, k, sorted=True)  # ties: topk does not promise lowest index
    best = torch.argmax(x)  # documented to return the first maximal index
    plogp = torch.where(p > 0, p * (x - lse), torch.zeros_like(p))
    entropy = -plogp.sum()
    if temperature != 0.0:
        if uniform is None:
            raise ValueError("scan: sampling needs a uniform draw")
        best = sample_index(torch.softmax((x - x.max()) / temperature, 0), top_k, top_p, uniform)
    token = ids[best] if ids is not None else best
    stats = torch.stack([token.float(), top_p2[0], top_p2[-1], entropy, lse]).tolist()  # one sync
    if not math.isfinite(stats[4]):  # a NaN or +inf makes the log-sum-exp NaN or +inf
        raise unreadable_logits(logits, ids)
    p_max = stats[1]
    margin = p_max - stats[2] if k > 1 else p_max
    # float32 holds every integer below 2**24, far above any vocabulary size
    return ScanResult(token_id=int(stats[0]), p_max=p_max, margin=margin, entropy=max(0.0, stats[3]), num_allowed=x.numel())


SMALL_ALLOWED_SET = 64

SAMPLING_HEADS = (256, 4096)
"""How many of the most likely tokens a sampled draw is looked for among, in turn, before the whole vocabulary is
sorted. Sorting it costs milliseconds on CPU (4 ms at 49k tokens, 13 ms at 152k); the top-k/top-p cut and the
draw nearly always fall among the first few hundred tokens."""


def sample_index(q: torch.Tensor, top_k: int, top_p: float, uniform: float,
                 heads: Sequence[int] | None = None) -> torch.Tensor:
    """The index into ``q`` (probabilities ``[n]``) that the contract's sampling picks: order by probability
    descending, id ascending on ties; cut to ``top_k``, then to the shortest prefix whose share of the cut's mass
    reaches ``top_p``; invert ``uniform`` over the prefix's cumulative mass.

    The order is built only as far as it is needed: the ``heads`` most likely tokens first (topk, then their
    ties put in id order), the whole vocabulary sorted only where the cut or the draw falls past the last head
    (``heads`` None: :data:`SAMPLING_HEADS` on CPU; empty: sort at once). Either way the same sums decide, so the
    answer does not depend on where it was found."""
    if heads is None:
        # On a GPU a sort is tens of microseconds and each look at a head costs host syncs: not measured to pay.
        heads = SAMPLING_HEADS if q.device.type == "cpu" else ()
    n = q.numel()
    cut = top_k if 0 < top_k < n else n
    total = q.sum()  # the mass of an uncut vocabulary: one sum, wherever the draw is found
    for head in heads:
        if head >= n:
            break
        values, ids = torch.topk(q, head, sorted=True)
        ids, by_id = torch.sort(ids)  # topk leaves equal values in no promised order: id ascending among them
        values, order = torch.sort(values[by_id], descending=True, stable=True)
        ids = ids[order]
        last = values[-1]
        # Tokens of the head's last value may lie outside it, lower ids among them: up to them the order is sure.
        known = head if bool((q == last).sum() == (values == last).sum()) else int((values > last).sum())
        index = _pick(values, ids, known, n, cut, total, top_p, uniform)
        if index is not None:
            return index
    values, order = torch.sort(q, descending=True, stable=True)
    return _pick(values, order, n, n, cut, total, top_p, uniform)


def _pick(values: torch.Tensor, ids: torch.Tensor, known: int, n: int, cut: int, total: torch.Tensor,
          top_p: float, uniform: float) -> torch.Tensor | None:
    # values, ids: probabilities and their token indices, the first `known` in the contract's order, of `n` in all;
    # None when the cut or the draw lies past them
    complete = cut <= known  # the whole top-k prefix is in the known order
    if known == 0 or (cut < n and not complete):
        return None
    length = min(cut, known)
    cum = torch.cumsum(values[:length], 0)
    mass = total if cut == n else cum[-1]
    if top_p < 1.0:
        keep = int(torch.searchsorted(cum / mass, torch.tensor([top_p], device=cum.device), right=False)) + 1
        if keep > length:
            if not complete:
                return None
            keep = length  # the share falls short of top_p only by rounding: the whole prefix
        cum, length, complete = cum[:keep], keep, True
        mass = cum[-1]
    index = int(torch.searchsorted(cum, (uniform * mass).reshape(1), right=True))
    if index >= length:
        if not complete:
            return None
        index = length - 1  # past the last token only by rounding
    return ids[index]


def _scan_small(values: list[float], ids: list[int]) -> ScanResult:
    """Greedy scan of a few allowed logits on the host, in float64 like the reference (``ids`` in id order)."""
    top = max(values)
    if not math.isfinite(top) or any(v != v for v in values):  # max() passes over a NaN after the first value
        raise _unreadable(np.asarray(values, dtype=np.float64), ids)
    exps = [math.exp(v - top) for v in values]
    total = math.fsum(exps)
    probs = [e / total for e in exps]
    first = values.index(top)  # the first maximal one in allowed order, as the reference's stable sort
    second = max((p for i, p in enumerate(probs) if i != first), default=None)
    p_max = probs[first]
    entropy = -math.fsum(p * math.log(p) for p in probs if p > 0)
    margin = p_max - second if second is not None else p_max
    return ScanResult(token_id=ids[first], p_max=p_max, margin=margin, entropy=max(0.0, entropy), num_allowed=len(ids))


def scan_onnxruntime(logits, **kwargs) -> ScanResult:
    """ONNX Runtime on CPU (``prepos.scan_onnxruntime``), imported on first use."""
    from prepos.scan_onnxruntime import scan_onnxruntime as scan

    return scan(logits, **kwargs)


SCANS: dict[str, ScanFn] = {"numpy": scan_numpy, "torch": scan_torch, "onnxruntime": scan_onnxruntime}


def get_scan(name: str) -> ScanFn:
    try:
        return SCANS[name]
    except KeyError:
        raise ValueError(f"unknown scan implementation {name!r}; known: {', '.join(sorted(SCANS))}") from None
