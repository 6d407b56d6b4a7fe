"""How the torch engine lays out and multiplies its CPU matrices, measured: the evidence behind
``cpu_chunks``, the host arena and the CPU GEMV kernel.

1. For each weight-matrix shape of the model, read bandwidth of a decode GEMV (one
   ``bmm`` over the matrix's column blocks) at several block counts, over one copy
   per layer so the weights come from memory, not cache.
2. Decode steps of two engines in one process, the packing of ``cpu_chunks`` and
   one block per thread, in alternating blocks of steps so both see the same
   machine: p50 and p99 of each and the ratio of the p50s.
3. The same paired decode for the weights in the huge-page host arena
   (``prepos.engines.host_arena``) and in ordinary torch allocations, both on torch's ops.
4. The same paired decode for the CPU kernels (``prepos.engines.cpu_kernels``, every
   matrix in 32-column blocks) and torch's ops over ``cpu_chunks`` (the GEMV kernel
   also gets a column in the sweep of 1).
5. One token's attention in every layer over a cache of 100 to 6,000 keys: the
   kernel's against SDPA's.
6. Prefill: each matrix shape's product for 40 rows, the CPU GEMM kernel's GFLOP/s
   against torch's matmul over the same 32-column blocks; causal attention in every
   layer, the prefill attention kernel's against SDPA's; then prefills of the two
   engines of part 4 in alternating blocks (40 tokens over a 300- and a 2,000-token
   prefix, and 512 tokens from nothing): p50 and p99 of each and the ratio of the p50s.
7. Decode batching: one decode step of 1, 2, 4, 8 and 16 sessions (300 cached tokens
   each) through ``decode_batch``, the batch sizes taken in turn: time per step and
   per token, and the step's time over one session's; then the GEMM kernel alone
   over every layer matrix at the same numbers of rows.
8. Prefill batching: 8 sessions (200 cached tokens each) prefilling 8, 32 and 64 new
   tokens each, as one ``prefill_batch`` call and as 8 ``prefill`` calls, taken in turn:
   time of each and the ratio.
9. Threads: decode steps (one session, then 8 in one batch) on the thread that loaded
   the engine, on a second thread while the first keeps its OpenMP workers, and on a
   second thread after the first released them (``prepos.engines.openmp``), as the
   server's engine loop runs. Run last: the release leaves the main thread on one thread.

    python loadtest/chunking_bench.py --model-dir engines/smollm2-135m-instruct [--parts sweep,chunks,pages,kernel,attention,prefill,batch,prefills,thread]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "backend"))

import prepos.engines.llama_weights as llama_weights  # noqa: E402
import prepos.engines.torch_llama as torch_llama  # noqa: E402
from prepos.engines import cpu_kernels  # noqa: E402
from prepos.engines.openmp import release_calling_thread  # noqa: E402
from prepos_loadtest.stats import percentile  # noqa: E402


BLOCK_COUNTS = (2, 4, 8, 16, 32, 64)
PARTS = ("sweep", "chunks", "pages", "kernel", "attention", "prefill", "batch", "prefills", "thread")
BATCH_SIZES = (1, 2, 4, 8, 16)
PREFILLS = ((300, 40), (2000, 40), (0, 512))  # (cached prefix, new tokens)
PREFILL_BATCH_NEW = (8, 32, 64)  # new tokens per session of a batched prefill
GEMM_ROWS = 40
ATTENTION_CONTEXTS = (100, 1000, 3000, 6000)


def gemv_sweep(shapes: dict[str, tuple[int, int]], layers: int, reps: int,
               kernel: cpu_kernels.CpuKernels | None = None) -> dict[str, dict[int | str, float]]:
    """GB/s of ``x @ W`` per shape and block count (medians of ``reps`` interleaved passes over ``layers`` copies);
    with ``kernel``, also the CPU GEMV kernel's over the 32-column blocks (key ``"kernel"``)."""
    result = {}
    for name, (d_in, out) in shapes.items():
        copies = 2 if name == "lm_head" else layers
        x = torch.randn(d_in)
        counts = [c for c in BLOCK_COUNTS if out % c == 0]
        if out % 32 == 0 and out // 32 not in counts:
            counts.append(out // 32)
        weights = {c: [torch.randn(c, d_in, out // c) for _ in range(copies)] for c in counts}
        times: dict[int | str, list[float]] = {c: [] for c in counts}
        if kernel is not None and out % 32 == 0:
            times["kernel"] = []
        for _ in range(reps):
            for c in counts:
                start = time.perf_counter()
                for w in weights[c]:
                    torch.bmm(x.expand(c, 1, -1), w)
                times[c].append(time.perf_counter() - start)
            if "kernel" in times:
                start = time.perf_counter()
                for w in weights[out // 32]:
                    kernel.gemv(w, x)
                times["kernel"].append(time.perf_counter() - start)
        nbytes = d_in * out * 4 * copies
        result[name] = {c: nbytes / statistics.median(t) / 1e9 for c, t in times.items()}
    return result


def paired_decode(engines: dict[str, torch_llama.TorchLlamaEngine], blocks: int, steps_per_block: int,
                  context: int = 100) -> dict[str, list[float]]:
    """Decode step times of each engine at ``context`` cached tokens, in alternating blocks of steps."""
    ids = list(range(100, 100 + context))
    times: dict[str, list[float]] = {k: [] for k in engines}
    with torch.inference_mode():
        for engine in engines.values():
            engine.prefill("bench", ids)
        order = list(engines.items())
        for block in range(blocks):
            for name, engine in order if block % 2 else order[::-1]:
                for step in range(steps_per_block + 2):
                    start = time.perf_counter()
                    engine.decode("bench", 17)
                    elapsed = time.perf_counter() - start
                    engine.truncate("bench", context)
                    if step >= 2:
                        times[name].append(elapsed)
    return times


def chunking_engines(model_dir: str) -> dict[str, torch_llama.TorchLlamaEngine]:
    packed = torch_llama.TorchLlamaEngine(model_dir, cpu_kernels=False)
    rule = llama_weights.cpu_chunks
    llama_weights.cpu_chunks = lambda out, threads: threads if threads > 1 and out % threads == 0 else 1
    try:
        per_thread = torch_llama.TorchLlamaEngine(model_dir, cpu_kernels=False)
    finally:
        llama_weights.cpu_chunks = rule
    return {"cpu_chunks": packed, "one block per thread": per_thread}


def page_engines(model_dir: str) -> dict[str, torch_llama.TorchLlamaEngine]:
    # On torch's ops, as measured when the arena came in (the CPU kernels are compared in their own part).
    return {"host arena": torch_llama.TorchLlamaEngine(model_dir, cpu_kernels=False),
            "torch allocations": torch_llama.TorchLlamaEngine(model_dir, host_arena=False, cpu_kernels=False)}


def interleaved_medians(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each run over ``reps`` passes that take every run in turn, after two warm-up passes."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def attention_sweep(layers: int, kv_heads: int, group: int, head_dim: int, kernels: cpu_kernels.CpuKernels,
                    reps: int) -> dict[int, dict[str, float]]:
    """Seconds (median of ``reps``) for one token's attention in every layer, the kernel's and SDPA's, over a
    cache laid out like the engine's (``[layers, 2, kv_heads, capacity, head_dim]``, so it comes from memory)."""
    result = {}
    for n in ATTENTION_CONTEXTS:
        cap = -(-n // 256) * 256
        kv = torch.randn(layers, 2, kv_heads, cap, head_dim)
        q = torch.randn(kv_heads, group, head_dim)
        ks, vs = kv[:, 0, :, :n].unbind(0), kv[:, 1, :, :n].unbind(0)
        runs = {"kernel": lambda: [kernels.attend(q, ks[i], vs[i]) for i in range(layers)],
                "sdpa": lambda: [torch.nn.functional.scaled_dot_product_attention(q[None], ks[i][None], vs[i][None])
                                 for i in range(layers)]}
        result[n] = interleaved_medians(runs, reps)
    return result


def gemm_sweep(shapes: dict[str, tuple[int, int]], rows: int, reps: int, kernels: cpu_kernels.CpuKernels
               ) -> dict[str, dict[str, float]]:
    """GFLOP/s (median of ``reps``) of ``rows`` rows times each matrix shape packed in 32-column blocks: the GEMM
    kernel's and torch's matmul over the blocks (as the engine multiplies without the kernels)."""
    result = {}
    for name, (d_in, out) in shapes.items():
        w, x = torch.randn(out // cpu_kernels.BLOCK, d_in, cpu_kernels.BLOCK), torch.randn(rows, d_in)
        runs = {"kernel": lambda: kernels.gemm(w, x),
                "torch": lambda: torch.matmul(x, w).transpose(0, 1).reshape(rows, -1)}
        result[name] = {impl: 2 * rows * d_in * out / t / 1e9 for impl, t in interleaved_medians(runs, reps).items()}
    return result


def prefill_attention_sweep(layers: int, kv_heads: int, group: int, head_dim: int, kernels: cpu_kernels.CpuKernels,
                            reps: int) -> dict[tuple[int, int], dict[str, float]]:
    """Seconds (median of ``reps``) for the causal attention of each of ``PREFILLS`` in every layer, the prefill
    kernel's and SDPA's (with its causal flag from nothing, an offset mask over a prefix, as the engine calls it)."""
    result = {}
    for start, n in PREFILLS:
        kv = torch.randn(layers, 2, kv_heads, start + n, head_dim)
        q = torch.randn(n, kv_heads * group, head_dim)
        qh = q.transpose(0, 1)[None]
        pos = torch.arange(start + n)
        mask = (pos[None, :] <= pos[start:, None]) if start else None
        runs = {"kernel": lambda: [kernels.prefill_attend(q, kv[i, 0], kv[i, 1]) for i in range(layers)],
                "sdpa": lambda: [torch.nn.functional.scaled_dot_product_attention(
                    qh, kv[i, 0][None], kv[i, 1][None], attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                    for i in range(layers)]}
        result[(start, n)] = interleaved_medians(runs, reps)
    return result


def paired_prefill(engines: dict[str, torch_llama.TorchLlamaEngine], blocks: int, prefix: int, new: int
                   ) -> dict[str, list[float]]:
    """Times of each engine's prefill of ``new`` tokens over ``prefix`` cached ones, in alternating blocks."""
    ids = [(7 * i) % 40_000 + 100 for i in range(prefix + new)]
    times: dict[str, list[float]] = {k: [] for k in engines}
    order = list(engines.items())
    with torch.inference_mode():
        for block in range(blocks + 1):
            for name, engine in order if block % 2 else order[::-1]:
                engine.release("bench")
                if prefix:
                    engine.prefill("bench", ids[:prefix])
                start = time.perf_counter()
                engine.prefill("bench", ids)
                if block:  # the first block warms up
                    times[name].append(time.perf_counter() - start)
    return times


def batched_decode(engine: torch_llama.TorchLlamaEngine, reps: int, context: int = 300) -> dict[int, float]:
    """Median seconds of one ``decode_batch`` step for each of ``BATCH_SIZES`` sessions over ``context`` cached
    tokens each; the sizes take turns, and the sessions go back to ``context`` tokens after every step."""
    ids = [(7 * i) % 40_000 + 100 for i in range(context)]
    sessions = [f"bench-{i}" for i in range(max(BATCH_SIZES))]
    with torch.inference_mode():
        for sid in sessions:
            engine.prefill(sid, ids)

        def step(n: int) -> Callable[[], object]:
            def run() -> None:
                engine.decode_batch(sessions[:n], [ids[-1]] * n)
                for sid in sessions[:n]:
                    engine.truncate(sid, context)
            return run

        medians = interleaved_medians({str(n): step(n) for n in BATCH_SIZES}, reps)
    for sid in sessions:
        engine.release(sid)
    return {int(n): t for n, t in medians.items()}


def batched_prefill(engine: torch_llama.TorchLlamaEngine, reps: int, sessions: int = 8, context: int = 200
                    ) -> dict[int, dict[str, float]]:
    """For each of ``PREFILL_BATCH_NEW``: median seconds of ``sessions`` prefills of that many new tokens over
    ``context`` cached ones, as one ``prefill_batch`` call and one after another (taken in turn); the sessions
    go back to ``context`` tokens after every run."""
    ids = [(7 * i) % 40_000 + 100 for i in range(context)]
    sids = [f"bench-{i}" for i in range(sessions)]
    out = {}
    with torch.inference_mode():
        for sid in sids:
            engine.prefill(sid, ids)
        for new in PREFILL_BATCH_NEW:
            prompts = [[*ids, *((11 * i + 13 * j) % 40_000 + 100 for j in range(new))] for i in range(sessions)]

            def batched() -> None:
                engine.prefill_batch(sids, prompts)
                for sid in sids:
                    engine.truncate(sid, context)

            def serial() -> None:
                for sid, prompt in zip(sids, prompts):
                    engine.prefill(sid, prompt)
                for sid in sids:
                    engine.truncate(sid, context)

            out[new] = interleaved_medians({"batched": batched, "serial": serial}, reps)
    for sid in sids:
        engine.release(sid)
    return out


def layer_gemm_rows(shapes: dict[str, tuple[int, int]], layers: int, reps: int, kernels: cpu_kernels.CpuKernels
                    ) -> dict[int, float]:
    """Median seconds of the GEMM kernel over one copy per layer of every layer matrix (the weights come from
    memory, as in a decode step), for each of ``BATCH_SIZES`` rows; the row counts take turns."""
    weights = [torch.randn(out // cpu_kernels.BLOCK, d_in, cpu_kernels.BLOCK)
               for name, (d_in, out) in shapes.items() if name != "lm_head" for _ in range(layers)]

    def run(n: int) -> Callable[[], object]:
        xs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
        return lambda: [kernels.gemm(w, xs[w.shape[1]]) for w in weights]

    return {int(n): t for n, t in interleaved_medians({str(n): run(n) for n in BATCH_SIZES}, reps).items()}


def thread_decode(engine: torch_llama.TorchLlamaEngine, steps: int, context: int = 300) -> dict[str, dict[int, float]]:
    """Median seconds of a decode step of 1 and of 8 sessions, on this thread, on a second thread, and on a
    second thread after this one released its OpenMP workers."""
    ids = [(7 * i) % 40_000 + 100 for i in range(context)]
    sessions = [f"bench-{i}" for i in range(8)]
    for sid in sessions:
        engine.prefill(sid, ids)

    def measure() -> dict[int, float]:
        result = {}
        for n in (1, 8):
            times = []
            for _ in range(steps + 2):
                start = time.perf_counter()
                engine.decode_batch(sessions[:n], [ids[-1]] * n)
                times.append(time.perf_counter() - start)
                for sid in sessions[:n]:
                    engine.truncate(sid, context)
            result[n] = statistics.median(times[2:])
        return result

    def on_thread() -> dict[int, float]:
        out: dict[str, dict[int, float]] = {}
        worker = threading.Thread(target=lambda: out.setdefault("r", measure()))
        worker.start()
        worker.join()
        return out["r"]

    with torch.inference_mode():
        result = {"loading thread": measure(), "second thread": on_thread()}
        release_calling_thread()
        result["second thread, workers released"] = on_thread()
    return result


def kernel_engines(model_dir: str) -> dict[str, torch_llama.TorchLlamaEngine]:
    return {"cpu kernel": torch_llama.TorchLlamaEngine(model_dir),
            "torch matmul": torch_llama.TorchLlamaEngine(model_dir, cpu_kernels=False)}


def _print_paired(times: dict[str, list[float]], what: str = "decode step", tokens: int = 0) -> None:
    print(f"{what}, alternating blocks in one process:")
    for name, samples in times.items():
        rate = f"  {tokens / statistics.median(samples):.0f} tok/s" if tokens else ""
        print(f"  {name:22s} n={len(samples)}  p50 {statistics.median(samples) * 1e3:.2f} ms  "
              f"p99 {percentile(samples, 99) * 1e3:.2f} ms{rate}")
    first, second = times
    ratio = statistics.median(times[first]) / statistics.median(times[second])
    print(f"  p50 ratio {first} / {second}: {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face Llama checkpoint directory")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=15, help="passes per block count in the GEMV sweep")
    ap.add_argument("--blocks", type=int, default=16, help="alternating blocks of decode steps")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per block")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="comma-separated: sweep (GEMV sweep), chunks (paired decode of the packings, torch matmul), "
                         "pages (paired decode, host arena vs torch allocations), kernel (paired decode, the CPU "
                         "kernels vs torch's ops), attention (decode attention over a cache, kernel vs SDPA), "
                         "prefill (GEMM sweep and paired prefill, the CPU kernels vs torch's ops), batch (one "
                         "decode step of 1-16 sessions at once), thread (decode on the loading thread against the "
                         "engine loop's; last)")
    args = ap.parse_args()
    for name in ("reps", "blocks", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be at least 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads: must be at least 1, got {args.threads}")
    if not (Path(args.model_dir) / "config.json").is_file():
        ap.error(f"--model-dir: no config.json in {args.model_dir} (a Hugging Face Llama checkpoint directory, "
                 "e.g. engines/smollm2-135m-instruct after make engine)")
    parts = set(args.parts.split(","))
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {', '.join(PARTS)}")
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = torch_llama.TorchLlamaEngine(args.model_dir)
    h, hd = probe.hidden, probe.head_dim
    shapes = {"q/k/v": (h, (probe.n_heads + 2 * probe.n_kv_heads) * hd), "o": (probe.n_heads * hd, h),
              "gate/up": (h, 2 * probe.intermediate), "down": (probe.intermediate, h), "lm_head": (h, probe.vocab_size)}
    threads = torch.get_num_threads()
    layers = probe.n_layers
    probe_dims = dict(kv_heads=probe.n_kv_heads, group=probe.group, head_dim=probe.head_dim)
    del probe
    if "sweep" in parts:
        print(f"threads={threads}; GEMV read bandwidth, GB/s, by column blocks (* = cpu_chunks; "
              "kernel: the CPU GEMV kernel over 32-column blocks):")
        for name, by_count in gemv_sweep(shapes, layers, args.reps, cpu_kernels.load()).items():
            chosen = llama_weights.cpu_chunks(shapes[name][1], threads)
            cells = "  ".join(f"{c}{'*' if c == chosen else ''}: {gbs:.1f}" for c, gbs in by_count.items())
            print(f"  {name:8s} {shapes[name]}  {cells}")
    kernels = cpu_kernels.load()
    if "attention" in parts and kernels is not None:
        print(f"decode attention, {layers} layers ({probe_dims['kv_heads']} kv heads x {probe_dims['group']}, "
              f"head_dim {probe_dims['head_dim']}), ms per token:")
        for n, by_impl in attention_sweep(layers, reps=args.reps, kernels=kernels, **probe_dims).items():
            mb = layers * 2 * probe_dims["kv_heads"] * n * probe_dims["head_dim"] * 4 / 1e6
            print(f"  {n:5d} keys ({mb:5.0f} MB)  kernel {by_impl['kernel'] * 1e3:6.2f}  sdpa {by_impl['sdpa'] * 1e3:6.2f}"
                  f"  ratio {by_impl['kernel'] / by_impl['sdpa']:.2f}")
    for part, engines in (("chunks", chunking_engines), ("pages", page_engines), ("kernel", kernel_engines)):
        if part in parts:
            _print_paired(paired_decode(engines(args.model_dir), args.blocks, args.steps))
    if "prefill" in parts and kernels is not None:
        print(f"prefill products, {GEMM_ROWS} rows, GFLOP/s (kernel: the CPU GEMM kernel; torch: matmul over "
              "the same 32-column blocks):")
        for name, by_impl in gemm_sweep(shapes, GEMM_ROWS, args.reps, kernels).items():
            print(f"  {name:8s} {shapes[name]}  kernel {by_impl['kernel']:6.1f}  torch {by_impl['torch']:6.1f}  "
                  f"time kernel / torch {by_impl['torch'] / by_impl['kernel']:.2f}")
        print(f"prefill attention, {layers} layers, ms:")
        for (start, n), by_impl in prefill_attention_sweep(layers, reps=args.reps, kernels=kernels,
                                                           **probe_dims).items():
            print(f"  {n:4d} tokens over {start:4d}  kernel {by_impl['kernel'] * 1e3:7.2f}  "
                  f"sdpa {by_impl['sdpa'] * 1e3:7.2f}  ratio {by_impl['kernel'] / by_impl['sdpa']:.2f}")
        engines = kernel_engines(args.model_dir)
        for prefix, new in PREFILLS:
            _print_paired(paired_prefill(engines, args.blocks, prefix, new),
                          f"prefill of {new} tokens over {prefix} cached", new)
    if "batch" in parts:
        engine = torch_llama.TorchLlamaEngine(args.model_dir)
        print("decode_batch, one step of n sessions over 300 cached tokens each "
              f"({'CPU kernels' if engine.products.kernels is not None else 'torch ops'}):")
        by_size = batched_decode(engine, args.reps)
        del engine
        for n, seconds in by_size.items():
            print(f"  {n:3d} sessions  {seconds * 1e3:7.2f} ms per step  {seconds * 1e3 / n:6.2f} ms per token  "
                  f"step / one session's {seconds / by_size[1]:.2f}")
        if kernels is not None:
            print(f"  the GEMM kernel alone over every layer matrix ({layers} layers, from memory):")
            for n, seconds in layer_gemm_rows(shapes, layers, args.reps, kernels).items():
                print(f"  {n:3d} rows  {seconds * 1e3:7.2f} ms")
    if "prefills" in parts:
        engine = torch_llama.TorchLlamaEngine(args.model_dir)
        print("prefill_batch, 8 sessions over 200 cached tokens each, n new tokens each "
              f"({'CPU kernels' if engine.products.kernels is not None else 'torch ops'}):")
        for new, by_way in batched_prefill(engine, args.reps).items():
            print(f"  {new:3d} new tokens  one batch {by_way['batched'] * 1e3:7.1f} ms  one after another "
                  f"{by_way['serial'] * 1e3:7.1f} ms  ratio {by_way['serial'] / by_way['batched']:.2f}")
        del engine
    if "thread" in parts:
        print("decode step by thread (median of steps), 1 session / 8 sessions in one batch:")
        for where, by_n in thread_decode(torch_llama.TorchLlamaEngine(args.model_dir), args.blocks * 2).items():
            print(f"  {where:34s} {by_n[1] * 1e3:7.2f} ms / {by_n[8] * 1e3:7.2f} ms")

if __name__ == "__main__":
    main()
