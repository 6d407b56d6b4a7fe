"""Vocabulary-scan microbenchmark: each scan implementation against the memory-bandwidth bound.

A scan reads the logits once, so ``bytes(logits) / read_bandwidth`` is the
fastest it can be; the machine's read bandwidth is measured in the same run (the
best of large NumPy and torch sums over an array far above the last-level cache).
A positioned session's logits were written an idle window ago, so each timed
scan reads a different logits vector from a pool larger than that cache: the
timings are cold-cache reads, like the bound.

Implementations: ``numpy`` (reference), ``torch`` (CPU), ``cpu-kernel`` (the
compiled CPU kernel of ``prepos.scan_cpu``, one thread; with ``--temperature`` the
kernel gives the features and torch draws the token), ``torch, whole vocabulary
sorted`` and ``onnxruntime, whole vocabulary sorted`` (with ``--temperature``: the torch scan and the
ONNX graph sampling as they did before they looked among the most likely tokens first), ``onnxruntime``
(the standard ONNX form, one thread as served; more with ``--threads``), and where CUDA is
present ``torch-cuda`` (the torch scan on the GPU), ``triton-kernel`` (the OpenAI
Triton kernel of ``prepos.scan_triton``) and ``tensorrt`` (the plugin engine from
``prepos_build.scan_tensorrt``, needs TensorRT). These times are host-side: launch,
kernel and the one sync; ``loadtest/gpu_bench.py`` times the kernel on the device. Greedy scans
without choices unless ``--temperature`` is given.

    python loadtest/scan_bench.py --repeats 300 --json out/scan_bench.json
    python loadtest/scan_bench.py --agreement 20     (sampled tokens against the reference's, by temperature)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from prepos import scan as prepos_scan
from prepos.scan import scan_numpy, scan_torch
from prepos.scan_cpu import CpuKernelScan, CpuKernelUnavailable
from prepos.scan_onnxruntime import OnnxRuntimeScan
from prepos_loadtest.stats import percentile

log = logging.getLogger("scan_bench")

VOCAB_SIZES = (49_152, 128_256, 151_936)
POOL_BYTES = 128 << 20  # four times this machine's 32 MiB L3: every timed scan reads from memory


def read_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second of the best sum over a ``num_bytes`` float32 array (NumPy, then torch)."""
    a = np.ones(num_bytes // 4, dtype=np.float32)
    t = torch.from_numpy(a)
    best = float("inf")
    for fn in (lambda: a.sum(), lambda: t.sum()):
        fn()
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return num_bytes / best


def _implementations(threads: int, temperature: float) -> dict[str, tuple[str, Callable]]:
    """name -> (device, scan); devices 'cpu' or 'cuda'."""
    impls = {
        "numpy": ("cpu", scan_numpy),
        f"torch ({threads} thread{'s' if threads > 1 else ''})": ("cpu", scan_torch),
        "onnxruntime (1 thread)": ("cpu", OnnxRuntimeScan(num_threads=1)),
    }
    if temperature != 0.0:  # the scans as they sampled before they looked among the most likely tokens first
        impls["torch, whole vocabulary sorted"] = ("cpu", _sorting_everything(scan_torch))
        impls["onnxruntime, whole vocabulary sorted"] = ("cpu", OnnxRuntimeScan(num_threads=1, sampling_head=0))
    try:
        impls["cpu-kernel"] = ("cpu", CpuKernelScan())
    except CpuKernelUnavailable as exc:
        log.warning("cpu-kernel left out: %s", exc)
    if threads > 1:
        impls[f"onnxruntime ({threads} threads)"] = ("cpu", OnnxRuntimeScan(num_threads=threads))
    if torch.cuda.is_available():
        impls["torch-cuda"] = ("cuda", scan_torch)
        try:
            from prepos.scan_triton import TritonScan, TritonUnavailable

            impls["triton-kernel"] = ("cuda", TritonScan("cuda"))
        except (ImportError, TritonUnavailable) as exc:
            log.warning("triton-kernel left out: %s", exc)
        try:
            from prepos_build.scan_tensorrt import TensorRTScan, TensorRTUnavailable, build_engine

            path = build_engine(Path(tempfile.mkdtemp()) / "scan.engine", max_vocab=max(VOCAB_SIZES))
            impls["tensorrt"] = ("cuda", TensorRTScan(path))
        except (ImportError, TensorRTUnavailable, RuntimeError) as exc:
            log.warning("tensorrt left out: %s", exc)
    return impls


def _sorting_everything(scan: Callable) -> Callable:
    def sort_all(logits, **kwargs):
        saved, prepos_scan.SAMPLING_HEADS = prepos_scan.SAMPLING_HEADS, ()
        try:
            return scan(logits, **kwargs)
        finally:
            prepos_scan.SAMPLING_HEADS = saved

    return sort_all


def time_scan(scan: Callable, pool: list, kwargs: dict, repeats: int) -> list[float]:
    """Seconds per scan, each over the next logits vector of ``pool`` (cold in cache)."""
    for logits in pool[:5]:
        scan(logits, **kwargs)
    times = []
    for i in range(repeats):
        logits = pool[i % len(pool)]
        start = time.perf_counter()
        scan(logits, **kwargs)  # every implementation returns Python numbers: the time includes its sync
        times.append(time.perf_counter() - start)
    return times


def _logits_for(name: str, device: str, logits: np.ndarray):
    """``logits`` as the implementation ``name`` on ``device`` takes them: a tensor there for the torch-based
    ones, the NumPy array for the others."""
    if device == "cuda":
        return torch.from_numpy(logits).cuda()
    return torch.from_numpy(logits) if name.startswith(("torch", "cpu-kernel")) else logits


def _write_json(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def run(repeats: int, threads: int, temperature: float) -> dict:
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth()
    log.info("read bandwidth %.1f GB/s", bandwidth / 1e9)
    kwargs = {} if temperature == 0.0 else {"temperature": temperature, "top_p": 0.9, "uniform": 0.5}
    rng = np.random.default_rng(0)
    results: dict = {"machine": _machine(threads), "read_bandwidth_gbps": bandwidth / 1e9, "kwargs": kwargs,
                     "repeats": repeats, "rows": {}}
    impls = _implementations(threads, temperature)
    for vocab in VOCAB_SIZES:
        pool_np = [rng.normal(0, 4, vocab).astype(np.float32) for _ in range(max(8, POOL_BYTES // (vocab * 4)))]
        bound_us = vocab * 4 / bandwidth * 1e6
        results["rows"].setdefault("bandwidth bound", {})[vocab] = {"median_us": bound_us, "p99_us": bound_us}
        for name, (device, scan) in impls.items():
            pool = [_logits_for(name, device, x) for x in pool_np]
            times = time_scan(scan, pool, kwargs, repeats)
            row = {"median_us": statistics.median(times) * 1e6, "p99_us": percentile(times, 99) * 1e6}
            results["rows"].setdefault(name, {})[vocab] = row
            log.info("%s vocab %d: median %.1f us, p99 %.1f us", name, vocab, row["median_us"], row["p99_us"])
    return results


AGREEMENT_TEMPERATURES = (0.85, 5.0, 1000.0)
AGREEMENT_VOCABS = (49_152, 128_256)


def agreement(num_cases: int, threads: int, impls: dict | None = None) -> dict:
    """How often each CPU implementation's sampled token differs from the reference's: ``num_cases`` draws per
    temperature of :data:`AGREEMENT_TEMPERATURES` and vocabulary size (logits N(0, 2), a uniform draw, every
    other one with ``top_p`` 0.9). The float32 running sums round where the reference's float64 do not, and at a
    high temperature (a nearly flat distribution) that rounding is more than one token's probability."""
    if impls is None:
        impls = {name: scan for name, (device, scan) in _implementations(threads, 1.0).items()
                 if device == "cpu" and name != "numpy" and "whole vocabulary" not in name}
    rng = np.random.default_rng(1)
    rows = {name: {t: 0 for t in AGREEMENT_TEMPERATURES} for name in impls}
    for temperature in AGREEMENT_TEMPERATURES:
        for vocab in AGREEMENT_VOCABS:
            for case in range(num_cases):
                logits = rng.normal(0, 2, vocab).astype(np.float32)
                kwargs = {"temperature": temperature, "top_p": 0.9 if case % 2 else 1.0, "uniform": float(rng.random())}
                want = scan_numpy(logits, **kwargs).token_id
                for name, scan in impls.items():
                    rows[name][temperature] += scan(_logits_for(name, "cpu", logits), **kwargs).token_id != want
    return {"machine": _machine(threads), "cases": num_cases * len(AGREEMENT_VOCABS), "rows": rows}


def agreement_table(result: dict) -> str:
    """Markdown: per implementation, the draws whose token differs from the reference's, by temperature."""
    lines = [f"Sampled tokens that differ from the reference's ({result['machine']}; of {result['cases']} draws "
             f"per temperature over {', '.join(f'{v:,}' for v in AGREEMENT_VOCABS)} tokens, logits N(0, 2), half "
             "with top_p 0.9)", "",
             "| implementation | " + " | ".join(f"temperature {t:g}" for t in AGREEMENT_TEMPERATURES) + " |",
             "|" + " --- |" * (len(AGREEMENT_TEMPERATURES) + 1)]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | " + " | ".join(str(row[t]) for t in AGREEMENT_TEMPERATURES) + " |")
    return "\n".join(lines)


def _machine(threads: int) -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    used = f"{threads} thread{'s' if threads > 1 else ''} used"
    load = f"load average {os.getloadavg()[0]:.1f}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores ({used}, {load}), {gpu}"


def table(results: dict) -> str:
    """Markdown: one row per implementation, median / p99 microseconds per vocabulary size."""
    head = "| implementation | " + " | ".join(f"{v:,} median / p99 µs" for v in VOCAB_SIZES) + " |"
    lines = [f"Scan time ({results['machine']}; read bandwidth {results['read_bandwidth_gbps']:.1f} GB/s; "
             f"fp32 logits, cold cache, {results['repeats']} scans each; "
             f"{'greedy' if not results['kwargs'] else 'sampling ' + json.dumps(results['kwargs'])})", "",
             head, "|" + " --- |" * (len(VOCAB_SIZES) + 1)]
    for name, row in results["rows"].items():
        cells = [f"{row[v]['median_us']:.0f} / {row[v]['p99_us']:.0f}" if name != "bandwidth bound"
                 else f"{row[v]['median_us']:.0f}" for v in VOCAB_SIZES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=300, help="timed scans per implementation and size (%(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch (and, above 1, an extra "
                   "ONNX Runtime row with as many); the served ONNX Runtime scan uses one (%(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 times greedy scans; > 0 sampling (top_p 0.9)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--agreement", type=int, default=0, metavar="N",
                   help="instead of timing: N sampled draws per temperature and vocabulary size, counting the "
                   "tokens each CPU implementation draws differently from the reference")
    args = p.parse_args(argv)
    if args.agreement < 0:
        p.error(f"--agreement: must be >= 0, got {args.agreement}")
    if args.repeats < 1 or args.threads < 1 or not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error("--repeats and --threads must be >= 1, --temperature a number >= 0")
    if args.json:  # before the run, not after it
        from prepos.launch_checks import unusable_folder

        if args.json.is_dir():
            problem = f"{args.json} is a folder"
        elif args.json.exists():  # written over: the file itself must be writable, whatever its folder allows
            problem = None if os.access(args.json, os.W_OK) else f"cannot write {args.json}"
        else:
            problem = unusable_folder(args.json.parent)
        if problem:
            p.error(f"--json: {problem}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.agreement:
        torch.set_num_threads(args.threads)
        results = agreement(args.agreement, args.threads)
        if args.json:
            _write_json(args.json, results)
        sys.stdout.write(agreement_table(results) + "\n")
        return 0
    results = run(args.repeats, args.threads, args.temperature)
    if args.json:
        _write_json(args.json, results)
    sys.stdout.write(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
