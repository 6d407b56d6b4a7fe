"""Figure a: first-token latency versus entry length for `prefix`, `prepaid` and `gated`, with the cost model.

The closed-form model of a first token on this server:

    TTFT = c0 + c_pass * [a forward pass is on the critical path]
              + c_prefill * (tokens prefilled on the critical path)
              + c_scan * [answered by a vocabulary scan alone]

`c0` is the transport floor (the no-op model's client TTFT, measured in the
same run, not fitted); `c_pass`, `c_prefill` and `c_scan` are least squares
over every measured point. The first token of `prefix` and `prepaid` comes
from the logits of the prefill itself, so no decode step precedes it; the
decode step that later tokens pay is measured separately (client time per
token after the first) and reported beside the coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import probes
from .common import FigureOutput, FiguresConfig, Sample, SummaryRow, TokenCounter, percentile, progress, pyplot, \
    write_csv
from .server import FigureServer

PATHS = ("prefix", "prepaid", "gated")
COLORS = {"prefix": "tab:red", "prepaid": "tab:blue", "gated": "tab:green"}


@dataclass(frozen=True)
class CostModel:
    """The fitted coefficients (ms) and how well they fit."""

    c0_ms: float
    c_pass_ms: float
    c_prefill_ms_per_token: float
    c_scan_ms: float
    c_decode_ms_per_step: float  # measured separately; not part of a first token here
    num_points: int
    rms_residual_ms: float

    def predict(self, prefill_tokens: float, scan_only: bool) -> float:
        if scan_only:
            return self.c0_ms + self.c_scan_ms
        return self.c0_ms + self.c_pass_ms + self.c_prefill_ms_per_token * prefill_tokens


@dataclass(frozen=True)
class EntryLengthResult:
    samples: tuple[Sample, ...]
    floor: tuple[Sample, ...]
    model: CostModel


def measure(server: FigureServer, counter: TokenCounter, config: FiguresConfig) -> tuple[list[Sample], list[Sample]]:
    """The path samples (every entry length x path x repetition) and the floor samples."""
    samples, floors = [], []
    for repetition in range(config.repetitions):
        for length in config.entry_lengths:
            for path in PATHS:
                if path == "prefix":
                    sample = probes.prefix(server, counter, "a", length, config.gap_s)
                else:
                    sample = probes.positioned(server, counter, "a", length, path, config.gap_s)
                samples.append(sample)
                progress("[a] entry %4d tokens, %-7s (served %s): TTFT %.1f ms (rep %d/%d)", length, path,
                         sample.path, sample.ttft_ms, repetition + 1, config.repetitions)
            floors.append(probes.floor(server, "a", config.gap_s))
    return samples, floors


def fit(samples: list[Sample], floors: list[Sample], decode_step_ms: float) -> CostModel:
    """Least squares of TTFT - c0 on [forward pass, prefill tokens, scan only]."""
    c0 = float(np.median([s.ttft_ms for s in floors]))
    rows = [s for s in samples if s.path in PATHS]
    design = np.array([[0.0 if s.prefill_tokens == 0 else 1.0, float(s.prefill_tokens),
                        1.0 if s.prefill_tokens == 0 else 0.0] for s in rows])
    target = np.array([s.ttft_ms - c0 for s in rows])
    coefficients, *_ = np.linalg.lstsq(design, target, rcond=None)
    residual = target - design @ coefficients
    return CostModel(c0, float(coefficients[0]), float(coefficients[1]), float(coefficients[2]), decode_step_ms,
                     len(rows), float(math.sqrt(float(np.mean(residual ** 2)))) if len(rows) else math.nan)


def plot(result: EntryLengthResult, config: FiguresConfig, png: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7.5, 5))
    model = result.model
    for path in PATHS:
        points = [s for s in result.samples if s.path == path]
        if not points:
            continue
        axis.scatter([s.entry_tokens for s in points], [s.ttft_ms for s in points], s=14, alpha=0.45,
                     color=COLORS[path])
        lengths = sorted({s.nominal_tokens for s in points})
        medians = [percentile([s.ttft_ms for s in points if s.nominal_tokens == n], 50) for n in lengths]
        xs = [percentile([s.entry_tokens for s in points if s.nominal_tokens == n], 50) for n in lengths]
        axis.plot(xs, medians, "o", color=COLORS[path], label=f"{path}: measured (median)")
        predicted = [model.predict(percentile([s.prefill_tokens for s in points if s.nominal_tokens == n], 50),
                                   path == "gated") for n in lengths]
        axis.plot(xs, predicted, "--", color=COLORS[path], label=f"{path}: model")
    axis.axhline(model.c0_ms, color="0.5", linestyle=":", label=f"transport floor c0 = {model.c0_ms:.1f} ms")
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(config.entry_lengths), [str(n) for n in config.entry_lengths])
    axis.set_yscale("log")
    axis.set_xlabel("entry length: tokens in the session's log before the request")
    axis.set_ylabel("first-token latency, client (ms, log scale)")
    axis.set_title(f"First token vs entry length; model: c_pass {model.c_pass_ms:.1f} ms + "
                   f"{model.c_prefill_ms_per_token:.2f} ms/token, c_scan {model.c_scan_ms:.2f} ms", fontsize=9)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def run(server: FigureServer, counter: TokenCounter, config: FiguresConfig, out: Path) -> tuple[EntryLengthResult,
                                                                                               FigureOutput]:
    samples, floors = measure(server, counter, config)
    decode_ms = probes.decode_step_ms(server, counter, config.anatomy_length, config.gap_s)
    progress("[a] decode step after the first token: %.1f ms", decode_ms)
    result = EntryLengthResult(tuple(samples), tuple(floors), fit(samples, floors, decode_ms))
    png, points_csv, model_csv = out / "a_entry_length.png", out / "a_entry_length.csv", out / "a_cost_model.csv"
    write_csv(points_csv, [*samples, *floors])
    m = result.model
    write_csv(model_csv, [
        {"coefficient": "c0_ms", "value": m.c0_ms, "how": "transport floor: median client TTFT of the no-op model"},
        {"coefficient": "c_pass_ms", "value": m.c_pass_ms, "how": "least squares: a forward pass on the path"},
        {"coefficient": "c_prefill_ms_per_token", "value": m.c_prefill_ms_per_token,
         "how": "least squares: per token prefilled on the path"},
        {"coefficient": "c_scan_ms", "value": m.c_scan_ms, "how": "least squares: an answer from a scan alone"},
        {"coefficient": "c_decode_ms_per_step", "value": m.c_decode_ms_per_step,
         "how": "measured: client time per token after the first (not on a first token here)"},
        {"coefficient": "rms_residual_ms", "value": m.rms_residual_ms, "how": f"over {m.num_points} points"},
    ])
    plot(result, config, png)
    rows = [SummaryRow("a", "cost model (ms)",
                       f"c0 {m.c0_ms:.2f} + c_pass {m.c_pass_ms:.1f} + c_prefill {m.c_prefill_ms_per_token:.3f}/token;"
                       f" c_scan {m.c_scan_ms:.2f}; c_decode {m.c_decode_ms_per_step:.1f}/step; "
                       f"rms residual {m.rms_residual_ms:.1f} over {m.num_points} points")]
    for length in config.entry_lengths:
        cells = []
        for path in PATHS:
            values = [s.ttft_ms for s in samples if s.nominal_tokens == length and s.path == path]
            cells.append(f"{path} {percentile(values, 50):.1f}" if values else f"{path} -")
        rows.append(SummaryRow("a", f"client TTFT p50 at entry {length} tokens (ms)", ", ".join(cells)))
    return result, FigureOutput(png, (points_csv, model_csv), tuple(rows))
