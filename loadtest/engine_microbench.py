"""Decode/prefill microbenchmark of the torch engine against the memory-bandwidth floor.

A decode step reads every weight once, so ``weight_bytes / read_bandwidth`` is the
fastest a step can be; the engine's decode step is reported as a ratio to that bound,
next to plain transformers eager decoding (DynamicCache) at the same context.

    python loadtest/engine_microbench.py --model-dir /path/to/hf-llama --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "backend"))

from prepos.engines.host_arena import HostArena  # noqa: E402
from prepos.engines.torch_llama import TorchLlamaEngine  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402

log = logging.getLogger("engine_microbench")

CHUNK_TOKENS = 32  # scheduler.chunk_tokens' default: a pre-positioning's chunk in chunked_prefill
TURN_TOKENS = 35  # a turn's new tokens in turn_growth: a short user message, its framing and cue


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def read_bandwidth(device: str, gib: float = 1.0, runs: int = 7) -> float:
    """Read bandwidth in bytes/s: median time of a sum over a buffer far bigger than any cache.

    On CPU the buffer comes from a host arena, on huge pages like the engine's weights, so the
    bound is the machine's fastest read rather than one slowed by 4 KiB pages' TLB misses.
    """
    count = int(gib * 2**30) // 4
    if device == "cpu":
        buf = HostArena(count * 4).take((count,), torch.float32).fill_(1.0)
    else:
        buf = torch.ones(count, dtype=torch.float32, device=device)
    buf.sum()  # warm: page faults, thread pool
    times = [_timed(buf.sum, device) for _ in range(runs)]
    n = buf.numel() * buf.element_size()
    del buf
    return n / statistics.median(times)


def engine_decode(engine: TorchLlamaEngine, ids: list[int], steps: int, device: str) -> list[float]:
    """Step times of ``steps`` decodes, each at position ``len(ids)`` (KV truncated back between)."""
    engine.prefill("bench", ids)
    times = []
    for i in range(steps + 3):
        dt = _timed(lambda: engine.decode("bench", 17), device)
        engine.truncate("bench", len(ids))
        if i >= 3:
            times.append(dt)
    engine.release("bench")
    return times


def paired_rounds(engine: TorchLlamaEngine, ids: list[int], steps: int, device: str, rounds: int) -> list[dict]:
    """``rounds`` pairs of (read bandwidth, decode steps), measured back to back.

    A shared machine's bandwidth moves between seconds; pairing each round's decode
    steps with the probe just before them compares both under the same conditions.
    Each round: ``bandwidth`` (bytes/s), ``decode`` (step times) and ``ratio``
    (median step over that round's bound).
    """
    per_round = max(1, steps // rounds)
    out = []
    for _ in range(rounds):
        bandwidth = read_bandwidth(device, runs=3)
        times = engine_decode(engine, ids, per_round, device)
        out.append({"bandwidth": bandwidth, "decode": times,
                    "ratio": statistics.median(times) / (engine.info.weight_bytes / bandwidth)})
    return out


def engine_prefill(engine: TorchLlamaEngine, ids: list[int], ext: list[int], device: str, runs: int) -> float:
    """Median seconds to extend a session holding ``ids`` by ``ext`` (only ``ext`` is computed)."""
    engine.prefill("bench", ids)
    times = []
    for _ in range(runs):
        before = engine.num_computed_tokens
        times.append(_timed(lambda: engine.prefill("bench", ids + ext), device))
        assert engine.num_computed_tokens - before == len(ext)
        engine.truncate("bench", len(ids))
    engine.release("bench")
    return statistics.median(times)


def _crop(cache, n: int) -> None:
    """Cut a transformers cache back to ``n`` tokens (its crop takes how many to remove, negated)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def hf_eager(model_dir: str, ids: list[int], steps: int, exts: dict[int, list[int]], device: str, dtype: str):
    """Plain transformers: decode step times with DynamicCache at a fixed context, and prefill seconds."""
    from transformers import DynamicCache, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    prompt = torch.tensor([ids], device=device)
    token = torch.tensor([[17]], device=device)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(prompt, past_key_values=cache, use_cache=True)
        times = []
        for i in range(steps + 3):
            dt = _timed(lambda: model(token, past_key_values=cache, use_cache=True), device)
            _crop(cache, len(ids))
            if i >= 3:
                times.append(dt)
        prefill = {}
        for n, ext in exts.items():
            new = torch.tensor([ext], device=device)
            runs = []
            for _ in range(2):
                runs.append(_timed(lambda: model(new, past_key_values=cache, use_cache=True, logits_to_keep=1), device))
                _crop(cache, len(ids))
            prefill[n] = statistics.median(runs)
    return times, prefill


def turn_growth(engine: TorchLlamaEngine, ids: list[int], ext: list[int], device: str, runs: int) -> dict:
    """Seconds of a turn that extends a session by ``ext``: its KV full, so the turn grows it (a copy of the
    whole KV, paid by the turn), against room made ahead (``reserve``, as the scheduler does after
    pre-positioning), in alternating runs. The session holds ``ids`` cut to whole KV blocks."""
    n = len(ids) - len(ids) % engine.kv_block_tokens
    ids = ids[:n]
    engine.prefill("bench", ids)
    times: dict[str, list[float]] = {"full": [], "room": []}
    for _ in range(runs):
        for which, runs_of in times.items():
            if which == "room":
                engine.reserve("bench", n + n // 16)
            runs_of.append(_timed(lambda: engine.prefill("bench", ids + ext), device))
            engine.truncate("bench", n)  # a full KV again
    engine.release("bench")
    return {"tokens": n, "delta": len(ext), **{f"{which}_ms": [t * 1e3 for t in v] for which, v in times.items()}}


def chunked_prefill(engine: TorchLlamaEngine, ids: list[int], chunk: int, device: str, runs: int) -> dict:
    """Seconds to prefill ``ids`` into a new session ``chunk`` tokens at a time, as pre-positioning does: the KV
    grown at every chunk that passes its capacity, against room made for all of them first (what
    ``share_prefix`` does before the first chunk), in alternating runs."""
    times: dict[str, list[float]] = {"grown": [], "room": []}

    def prefill_in_chunks(room: bool) -> None:
        if room:
            engine.share_prefix("bench", ids)
        for end in range(chunk, len(ids) + chunk, chunk):
            engine.prefill("bench", ids[:min(end, len(ids))])

    for _ in range(runs):
        for which, runs_of in times.items():
            runs_of.append(_timed(lambda: prefill_in_chunks(which == "room"), device))
            engine.release("bench")
    return {"tokens": len(ids), "chunk": chunk, **{f"{which}_s": v for which, v in times.items()}}


def measure(model_dir: str, *, device: str = "cpu", dtype: str = "float32", threads: int | None = None,
            context: int = 100, steps: int = 50, prefill_runs: int = 3, with_hf: bool = True, rounds: int = 5,
            long_context: int = 2000, turn_runs: int = 7) -> dict:
    """Decode-step and prefill figures of the torch engine next to the memory-bandwidth bound (and HF eager).

    The decode/bound ratio is the median over ``rounds`` paired rounds (see :func:`paired_rounds`); the
    ratio against the fastest probe of the run, the strictest reading, is reported beside it. A decode step at
    ``long_context`` cached tokens (0: skipped) is set against its bound too: the weights plus the KV it reads,
    a turn over that many tokens is timed with the KV full and with room made ahead (:func:`turn_growth`), and
    their prefill in chunks with the KV grown chunk by chunk and with room made first (:func:`chunked_prefill`).
    """
    engine = TorchLlamaEngine(model_dir, device=device, dtype=dtype, num_threads=threads)
    info = engine.info
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, info.vocab_size, (context,), generator=gen).tolist()
    exts = {n: torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in (40, 512)}

    log.info("read bandwidth and engine decode, %d paired rounds ...", rounds)
    paired = paired_rounds(engine, ids, steps, device, rounds)
    dec = [t for r in paired for t in r["decode"]]
    bandwidths = [r["bandwidth"] for r in paired]
    bandwidth = statistics.median(bandwidths)
    bound = info.weight_bytes / bandwidth
    ratios = [r["ratio"] for r in paired]
    long_dec, turn, chunked = [], None, None
    if long_context:
        log.info("engine decode at %d cached tokens ...", long_context)
        long_ids = torch.randint(0, info.vocab_size, (long_context,), generator=gen).tolist()
        long_dec = engine_decode(engine, long_ids, max(5, steps // 5), device)
        log.info("a turn over %d cached tokens, KV full and with room made ahead ...", long_context)
        turn = turn_growth(engine, long_ids, exts[40][:TURN_TOKENS], device, turn_runs)
        log.info("a prefill of %d tokens in chunks of %d, grown chunk by chunk and with room made first ...",
                 long_context, CHUNK_TOKENS)
        chunked = chunked_prefill(engine, long_ids, CHUNK_TOKENS, device, prefill_runs)
    long_bytes = info.weight_bytes + (long_context + 1) * info.kv_bytes_per_token
    log.info("engine prefill ...")
    pre = {n: engine_prefill(engine, ids, ext, device, prefill_runs) for n, ext in exts.items()}
    hf_dec, hf_pre = (None, {})
    if with_hf:
        log.info("transformers eager ...")
        del engine
        hf_dec, hf_pre = hf_eager(model_dir, ids, steps, exts, device, dtype)

    med = statistics.median(dec)
    return {
        "model": os.path.basename(os.path.normpath(model_dir)),
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "context": context,
        "steps": steps,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "read_bandwidth_runs_gb_s": [b / 1e9 for b in bandwidths],
        "weight_bytes": info.weight_bytes,
        "decode_bound_ms": bound * 1e3,
        "engine_decode_median_ms": med * 1e3,
        "engine_decode_p99_ms": percentile(dec, 99) * 1e3,
        "engine_decode_ratio_to_bound": statistics.median(ratios),
        "engine_decode_ratio_rounds": ratios,
        "engine_decode_ratio_to_fastest_probe": med / (info.weight_bytes / max(bandwidths)),
        "long_context": long_context,
        "long_decode_median_ms": statistics.median(long_dec) * 1e3 if long_dec else None,
        "long_decode_bound_ms": long_bytes / bandwidth * 1e3,
        "turn": turn,
        "chunked": chunked,
        "hf_eager_decode_median_ms": statistics.median(hf_dec) * 1e3 if hf_dec else None,
        "engine_prefill_tok_s": {str(n): n / t for n, t in pre.items()},
        "hf_eager_prefill_tok_s": {str(n): n / t for n, t in hf_pre.items()},
    }


def format_table(result: dict) -> str:
    rows = [
        ("read bandwidth (median of rounds)", f"{result['read_bandwidth_gb_s']:.2f} GB/s"),
        ("read bandwidth per round", " ".join(f"{b:.0f}" for b in result["read_bandwidth_runs_gb_s"]) + " GB/s"),
        ("weight bytes / decode step", f"{result['weight_bytes'] / 1e6:.1f} MB"),
        ("memory-bound decode step", f"{result['decode_bound_ms']:.2f} ms"),
        (f"engine decode median @ctx {result['context']}", f"{result['engine_decode_median_ms']:.2f} ms"),
        (f"engine decode p99 @ctx {result['context']}", f"{result['engine_decode_p99_ms']:.2f} ms"),
        ("engine decode / bound (median of rounds)", f"{result['engine_decode_ratio_to_bound']:.2f}x"),
        ("per round", " ".join(f"{r:.2f}" for r in result["engine_decode_ratio_rounds"])),
        ("engine decode / bound at fastest probe", f"{result['engine_decode_ratio_to_fastest_probe']:.2f}x"),
    ]
    if result.get("long_decode_median_ms"):
        n = result["long_context"]
        rows += [(f"engine decode median @ctx {n}", f"{result['long_decode_median_ms']:.2f} ms"),
                 (f"bound @ctx {n} (weights + KV read)", f"{result['long_decode_bound_ms']:.2f} ms")]
    if result.get("turn"):
        t = result["turn"]
        for which, how in (("full", "KV full, grown by the turn"), ("room", "room made ahead")):
            runs = t[f"{which}_ms"]
            rows.append((f"turn +{t['delta']} over {t['tokens']}, {how}: median / max",
                         f"{statistics.median(runs):.1f} / {max(runs):.1f} ms"))
    if result.get("chunked"):
        c = result["chunked"]
        for which, how in (("grown", "KV grown chunk by chunk"), ("room", "room made first")):
            rows.append((f"prefill {c['tokens']} in chunks of {c['chunk']}, {how}: median",
                         f"{statistics.median(c[f'{which}_s']):.2f} s"))
    if result["hf_eager_decode_median_ms"]:
        rows.append((f"HF eager decode median @ctx {result['context']}", f"{result['hf_eager_decode_median_ms']:.2f} ms"))
    for n, tok_s in result["engine_prefill_tok_s"].items():
        rows.append((f"engine prefill +{n} tokens", f"{tok_s:.0f} tok/s"))
        if n in result["hf_eager_prefill_tok_s"]:
            rows.append((f"HF eager prefill +{n} tokens", f"{result['hf_eager_prefill_tok_s'][n]:.0f} tok/s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{result['model']} {result['device']}/{result['dtype']} threads={result['threads']}", "-" * (width + 16)]
    lines += [f"{k:<{width}}  {v:>12}" for k, v in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face Llama checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--context", type=int, default=100, help="cached tokens when decoding")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps (over all rounds)")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds of bandwidth probe and decode steps")
    ap.add_argument("--long-context", type=int, default=2000,
                    help="also time decode steps at this many cached tokens (0: skip)")
    ap.add_argument("--prefill-runs", type=int, default=3)
    ap.add_argument("--turn-runs", type=int, default=7,
                    help="runs of a turn over --long-context tokens, KV full and with room made ahead, each")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers here")
    args = ap.parse_args()
    for name in ("context", "steps", "rounds", "prefill_runs", "turn_runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    if args.long_context < 0 or (args.threads is not None and args.threads < 1):
        ap.error("--long-context must be >= 0 and --threads >= 1")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir: no config.json in {args.model_dir} (a Hugging Face Llama checkpoint directory, "
                 "e.g. engines/smollm2-135m-instruct after make engine)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(args.model_dir, device=args.device, dtype=args.dtype, threads=args.threads,
                     context=args.context, steps=args.steps, prefill_runs=args.prefill_runs, with_hf=not args.no_hf,
                     rounds=args.rounds, long_context=args.long_context, turn_runs=args.turn_runs)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
