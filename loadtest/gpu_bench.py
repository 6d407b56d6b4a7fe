"""GPU benchmark: the scan kernel against the memory bound, and the torch engine on CUDA at a realistic size.

Two parts, one JSON and one Markdown table:

- **scan**: the OpenAI Triton scan kernel (``prepos.scan_triton``) on 49k, 128k
  and 152k vocabularies, fp32/fp16/bf16 logits. Device time per scan comes from
  CUDA graphs of back-to-back scans, each over a different logits vector from a
  pool larger than the L2 cache (a positioned session's distribution was written
  an idle window ago), timed with CUDA events; next to it: an empty kernel timed
  the same way (the floor any one launch pays), the bound ``bytes / read
  bandwidth``, a batch of 64 rows in one launch (per row), and the host-side
  latency of one served scan (launch + the one sync), against ``scan_torch``.
- **engine**: random weights of a real architecture (``--arch``; Llama 3.2 1B by
  default), bf16, through ``PagedTorchLlamaEngine`` (paged KV, CUDA-graph decode)
  and the plain ``TorchLlamaEngine`` (eager): decode step against the bound
  ``weight bytes / read bandwidth``; and a session's first token on the
  ``prefix`` path (prefill a delta over a cached prefix, then scan) against the
  ``gated`` path (scan the cached distribution), the ratio the paper puts at
  39 ms vs 1.0 ms; and decode steps of 1, 8 and 32 sessions at once
  (``decode_batch``, a graph per batch size): step time and tokens/s.

    python loadtest/gpu_bench.py --json out/gpu_bench.json            (needs a CUDA device and Triton)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from prepos_loadtest.stats import percentile

log = logging.getLogger("gpu_bench")

VOCABS = (49_152, 128_256, 151_936)
BATCHES = (1, 8, 32)  # sessions per decode step in the engine part
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ARCHS = {  # Hugging Face config fields of the architectures the engine benchmark can build with random weights
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128_256, tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=8192),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128_256, tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=8192),
}


def read_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Bytes per second of the best of 10 sums over a buffer far larger than L2."""
    buf = torch.ones(num_bytes // 4, device="cuda")
    buf.sum()
    best = float("inf")
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        buf.sum()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return num_bytes / best


def _graph_time(step, count: int, repeats: int = 5) -> float:
    """Seconds per call of ``step(i)`` for i in range(count), captured as one graph (best of ``repeats``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            step(i)
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / count)
    return best


def bench_scan(bandwidth: float, host_repeats: int) -> dict:
    import triton

    from prepos.scan import scan_torch
    from prepos.scan_triton import TritonScan

    @triton.jit
    def _empty(x_ptr):
        pass

    dummy = torch.empty(1, device="cuda")
    floor = _graph_time(lambda i: _empty[(1,)](dummy), 200)
    rows = {}
    scan = TritonScan("cuda")
    for dname, dtype in DTYPES.items():
        for vocab in VOCABS:
            nbytes = vocab * dtype.itemsize
            pool_n = max(64, (256 << 20) // nbytes)  # 256 MiB of logits: five times the L2 cache
            pool = (torch.randn(pool_n, vocab, device="cuda") * 4).to(dtype)
            out = torch.empty(1, 5, device="cuda")
            per_scan = _graph_time(lambda i: scan.features(pool[i % pool_n], out=out), 200)
            batch = 64
            per_row = _graph_time(lambda i: scan.features(pool[(i * batch) % (pool_n - batch):][:batch]),
                                  20) / batch
            host = {}
            for name, fn in (("triton", scan), ("torch", scan_torch)):
                for i in range(5):
                    fn(pool[i])
                times = []
                for i in range(host_repeats):
                    t = time.perf_counter()
                    fn(pool[i % pool_n])
                    times.append(time.perf_counter() - t)
                host[name] = (statistics.median(times), percentile(times, 99))
            bound = nbytes / bandwidth
            rows[f"{dname}/{vocab}"] = {
                "bytes": nbytes, "bound_us": bound * 1e6, "kernel_us": per_scan * 1e6,
                "kernel_over_bound": per_scan / bound, "empty_kernel_us": floor * 1e6,
                "batch64_per_row_us": per_row * 1e6, "batch64_over_bound": per_row / bound,
                "host_triton_median_us": host["triton"][0] * 1e6, "host_triton_p99_us": host["triton"][1] * 1e6,
                "host_torch_median_us": host["torch"][0] * 1e6, "host_torch_p99_us": host["torch"][1] * 1e6,
            }
            log.info("scan %s: %s", f"{dname}/{vocab}", {k: round(v, 2) for k, v in rows[f"{dname}/{vocab}"].items()})
            pool = None  # free it before the next size
    return rows


def make_checkpoint(arch: str, path: Path) -> None:
    """Random bf16 weights of ``arch`` (std 0.02, norms 1) with its config.json, as a Hugging Face checkpoint."""
    from safetensors.torch import save_file

    cfg = dict(ARCHS[arch], architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
               hidden_act="silu", torch_dtype="bfloat16")
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"]
    hd = h // cfg["num_attention_heads"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    sd = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv * hd, h),
               p + "self_attn.v_proj.weight": w(kv * hd, h), p + "self_attn.o_proj.weight": w(h, h),
               p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
               p + "mlp.down_proj.weight": w(h, inter),
               p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
               p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t


def bench_decode_batches(engine, prefix: list[int], sizes: tuple[int, ...], steps: int) -> dict:
    """Decode steps of ``n`` sessions at once (``decode_batch``), each session holding ``prefix``: per size, the
    step's median and p99 seconds and tokens per second, and its cost relative to one session's step."""
    out: dict = {}
    sessions = [f"batch{i}" for i in range(max(sizes))]
    for sid in sessions:
        engine.prefill(sid, prefix)
    for n in sizes:
        batch = sessions[:n]
        times = []
        for i in range(steps + 3):  # the first steps of a size pay its graph's capture: left out
            times.append(_timed(lambda: engine.decode_batch(batch, [17] * n)))
            for sid in batch:
                engine.truncate(sid, len(prefix))
        times = times[3:]
        median = statistics.median(times)
        out[str(n)] = {"step_median_ms": median * 1e3, "step_p99_ms": percentile(times, 99) * 1e3,
                       "tokens_per_s": n / median}
        log.info("decode batch of %d: median %.3f ms, %.0f tokens/s", n, median * 1e3, n / median)
    for r in out.values():
        r["step_over_one"] = r["step_median_ms"] / out[str(sizes[0])]["step_median_ms"]
    for sid in sessions:
        engine.release(sid)
    return out


def bench_prefill_batch(engine, prefix: list[int], delta: list[int], sessions: int, runs: int) -> dict:
    """``sessions`` sessions each holding ``prefix`` prefill ``delta`` (its own tokens per session): as one
    ``prefill_batch`` call and one ``prefill`` after another, taken in turn; median and p99 seconds of each."""
    sids = [f"pbatch{i}" for i in range(sessions)]
    prompts = [[*prefix, *((t + 31 * i) % engine.info.vocab_size for t in delta)] for i in range(sessions)]
    for sid in sids:
        engine.prefill(sid, prefix)
    ways = {"batched": lambda: engine.prefill_batch(sids, prompts),
            "serial": lambda: [engine.prefill(sid, p) for sid, p in zip(sids, prompts)]}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for i in range(runs + 2):  # the first two of each pay kernel selection for new shapes: left out
        for way, run in ways.items():
            dt = _timed(run)
            for sid in sids:
                engine.truncate(sid, len(prefix))
            if i >= 2:
                times[way].append(dt)
    for sid in sids:
        engine.release(sid)
    out = {"sessions": sessions, "delta": len(delta)}
    for way, t in times.items():
        out[f"{way}_median_ms"], out[f"{way}_p99_ms"] = statistics.median(t) * 1e3, percentile(t, 99) * 1e3
    out["serial_over_batched"] = out["serial_median_ms"] / out["batched_median_ms"]
    log.info("prefill of %d sessions x %d tokens: batched %.3f ms, one after another %.3f ms", sessions, len(delta),
             out["batched_median_ms"], out["serial_median_ms"])
    return out


def bench_engine(arch: str, bandwidth: float, context: int, delta: int, steps: int, runs: int) -> dict:
    from prepos.engines.torch_llama import TorchLlamaEngine
    from prepos.engines.torch_paged import PagedTorchLlamaEngine
    from prepos.scan_triton import TritonScan

    with tempfile.TemporaryDirectory() as tmp:
        log.info("writing random %s weights ...", arch)
        make_checkpoint(arch, Path(tmp))
        paged = PagedTorchLlamaEngine(tmp, device="cuda", dtype="bfloat16", kv_pool_bytes=16 << 30,
                                      max_batch=max(BATCHES))
        eager = TorchLlamaEngine(tmp, device="cuda", dtype="bfloat16")
    info = paged.info
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, info.vocab_size, (context,), generator=gen).tolist()
    ext = torch.randint(0, info.vocab_size, (delta,), generator=gen).tolist()
    scan = TritonScan("cuda")
    bound = info.weight_bytes / bandwidth
    result: dict = {"arch": arch, "weight_bytes": info.weight_bytes, "decode_bound_ms": bound * 1e3,
                    "context": context, "delta": delta}
    for name, engine in (("paged+graph", paged), ("eager", eager)):
        engine.prefill("d", prefix)
        times = []
        for i in range(steps + 3):
            dt = _timed(lambda: engine.decode("d", 17))
            engine.truncate("d", context)
            if i >= 3:
                times.append(dt)
        engine.release("d")
        result[f"decode_{name}_median_ms"] = statistics.median(times) * 1e3
        result[f"decode_{name}_p99_ms"] = percentile(times, 99) * 1e3
        result[f"decode_{name}_over_bound"] = statistics.median(times) / bound
        log.info("decode %s: median %.3f ms (bound %.3f ms)", name, statistics.median(times) * 1e3, bound * 1e3)
    result["decode_batches"] = bench_decode_batches(paged, prefix, BATCHES, steps)
    result["prefill_batch"] = bench_prefill_batch(paged, prefix, ext, max(BATCHES) // 4, runs)
    # prefix path: the session holds `prefix`; a request's delta is prefilled, then its distribution scanned
    prefix_t, gated_t, tok_s = [], [], []
    paged.prefill("p", prefix)
    for _ in range(runs + 2):
        def first_token():
            scan(paged.prefill("p", prefix + ext))
        prefix_t.append(_timed(first_token))
        logits = paged.prefill("p", prefix + ext)  # the positioned distribution a gated answer reads
        gated_t.append(_timed(lambda: scan(logits)))
        paged.truncate("p", context)
    prefix_t, gated_t = prefix_t[2:], gated_t[2:]
    for n in (128, 1024):
        more = torch.randint(0, info.vocab_size, (n,), generator=gen).tolist()
        times = []
        for _ in range(5):  # the first at a new length pays kernel selection: left out
            times.append(_timed(lambda: paged.prefill("p", prefix + more)))
            paged.truncate("p", context)
        t = statistics.median(times[1:])
        tok_s.append((n, n / t))
    result |= {
        "prefix_first_token_median_ms": statistics.median(prefix_t) * 1e3, "prefix_first_token_p99_ms": percentile(prefix_t, 99) * 1e3,
        "gated_first_token_median_ms": statistics.median(gated_t) * 1e3, "gated_first_token_p99_ms": percentile(gated_t, 99) * 1e3,
        "prefix_over_gated": statistics.median(prefix_t) / statistics.median(gated_t),
        "prefill_tok_s": {str(n): v for n, v in tok_s},
    }
    log.info("engine: %s", result)
    return result


def table(res: dict) -> str:
    lines = [f"GPU benchmark ({res['gpu']}, torch {res['torch']}, triton {res['triton']}; read bandwidth "
             f"{res['read_bandwidth_gbps']:.0f} GB/s)", ""]
    if "scan" in res:
        lines += ["| logits | bound µs | kernel µs (x bound) | empty kernel µs | batch of 64: µs/row (x bound) "
                  "| served scan, host µs median / p99: triton | torch |", "|" + " --- |" * 7]
        for key, r in res["scan"].items():
            lines.append(f"| {key} | {r['bound_us']:.2f} | {r['kernel_us']:.2f} ({r['kernel_over_bound']:.1f}x) | "
                         f"{r['empty_kernel_us']:.2f} | {r['batch64_per_row_us']:.2f} ({r['batch64_over_bound']:.1f}x) | "
                         f"{r['host_triton_median_us']:.0f} / {r['host_triton_p99_us']:.0f} | "
                         f"{r['host_torch_median_us']:.0f} / {r['host_torch_p99_us']:.0f} |")
        lines.append("")
    for e in res.get("engines", []):
        lines += [f"Engine, {e['arch']} random weights, bf16, {e['weight_bytes'] / 1e9:.2f} GB read per decode step, "
                  f"context {e['context']}:", "",
                  "| figure | median | p99 |", "| --- | --- | --- |",
                  f"| decode step bound (weights / bandwidth) | {e['decode_bound_ms']:.3f} ms | |",
                  f"| decode step, paged KV + CUDA graph | {e['decode_paged+graph_median_ms']:.3f} ms "
                  f"({e['decode_paged+graph_over_bound']:.2f}x bound) | {e['decode_paged+graph_p99_ms']:.3f} ms |",
                  f"| decode step, eager | {e['decode_eager_median_ms']:.3f} ms ({e['decode_eager_over_bound']:.2f}x) "
                  f"| {e['decode_eager_p99_ms']:.3f} ms |",
                  f"| `prefix` first token (+{e['delta']} tokens, then scan) | {e['prefix_first_token_median_ms']:.3f} ms "
                  f"| {e['prefix_first_token_p99_ms']:.3f} ms |",
                  f"| `gated` first token (scan of the cached distribution) | {e['gated_first_token_median_ms']:.3f} ms "
                  f"| {e['gated_first_token_p99_ms']:.3f} ms |",
                  f"| prefix / gated | {e['prefix_over_gated']:.0f}x | |"]
        lines += [f"| prefill +{n} tokens | {v:,.0f} tok/s | |" for n, v in e["prefill_tok_s"].items()]
        lines += [f"| decode step of {n} sessions (paged + graph) | {r['step_median_ms']:.3f} ms "
                  f"({r['step_over_one']:.2f}x one session's; {r['tokens_per_s']:,.0f} tokens/s) "
                  f"| {r['step_p99_ms']:.3f} ms |" for n, r in e.get("decode_batches", {}).items()]
        if "prefill_batch" in e:
            p = e["prefill_batch"]
            lines += [f"| prefill of {p['sessions']} sessions x {p['delta']} tokens, one batch | "
                      f"{p['batched_median_ms']:.3f} ms | {p['batched_p99_ms']:.3f} ms |",
                      f"| prefill of {p['sessions']} sessions x {p['delta']} tokens, one after another | "
                      f"{p['serial_median_ms']:.3f} ms ({p['serial_over_batched']:.2f}x the batch) | "
                      f"{p['serial_p99_ms']:.3f} ms |"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", action="append", choices=sorted(ARCHS), help="engine architectures (default llama-3.2-1b)")
    p.add_argument("--context", type=int, default=2000, help="tokens the session holds (%(default)s)")
    p.add_argument("--delta", type=int, default=60, help="tokens a prefix-path request brings (%(default)s)")
    p.add_argument("--steps", type=int, default=100, help="timed decode steps (%(default)s)")
    p.add_argument("--runs", type=int, default=50, help="timed first tokens per path (%(default)s)")
    p.add_argument("--host-repeats", type=int, default=300, help="timed served scans per case (%(default)s)")
    p.add_argument("--skip", choices=["scan", "engine"], action="append", default=[])
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    import triton

    bandwidth = read_bandwidth()
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
                 "read_bandwidth_gbps": bandwidth / 1e9, "date": time.strftime("%Y-%m-%d")}
    if "scan" not in args.skip:
        res["scan"] = bench_scan(bandwidth, args.host_repeats)
    if "engine" not in args.skip:
        res["engines"] = [bench_engine(a, bandwidth, args.context, args.delta, args.steps, args.runs)
                          for a in args.arch or ["llama-3.2-1b"]]
    text = table(res)
    for path, body in ((args.json, json.dumps(res, indent=2) + "\n"), (args.markdown, text + "\n")):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
