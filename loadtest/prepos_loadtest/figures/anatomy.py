"""Figure b: where a first token's time goes, per served path, at one representative entry length.

From the response fields: queue (arrival to pickup by the engine loop),
prefill, decode and scan (engine time up to the first token), other server
compute (the rest of the server's first-token time: tokenizing, bookkeeping,
building the response), and transport (client TTFT minus the server's
first-token time: gRPC, Triton and the Python backend both ways). Bars are
means over the repetitions, so the stack adds up to the mean client TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import probes
from .common import FigureOutput, FiguresConfig, Sample, SummaryRow, TokenCounter, mean, progress, pyplot, write_csv
from .server import FigureServer

PATHS = ("exact", "gated", "prepaid", "prefix", "rebuild")
PARTS = ("queue", "prefill", "decode", "scan", "other server", "transport")
PART_COLORS = ("tab:gray", "tab:red", "tab:purple", "tab:green", "tab:olive", "tab:cyan")


@dataclass(frozen=True)
class Anatomy:
    """Mean milliseconds of each part of the first token, for one served path."""

    path: str
    num_samples: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    scan_ms: float
    other_server_ms: float
    transport_ms: float
    client_ttft_ms: float

    def parts(self) -> tuple[float, ...]:
        return (self.queue_ms, self.prefill_ms, self.decode_ms, self.scan_ms, self.other_server_ms,
                self.transport_ms)


def _parts(sample: Sample) -> tuple[float, ...]:
    server = sample.first_token_ms if sample.first_token_ms is not None else sample.ttft_ms
    known = [sample.queue_ms or 0.0, sample.prefill_ms or 0.0, sample.decode_ms or 0.0, sample.scan_ms or 0.0]
    # Server timers come from separate clock reads: a negative remainder is rounding, not time.
    return (*known, max(0.0, server - sum(known)), max(0.0, sample.ttft_ms - server))


def anatomy_of(path: str, samples: list[Sample]) -> Anatomy | None:
    chosen = [s for s in samples if s.path == path]
    if not chosen:
        return None
    columns = list(zip(*[_parts(s) for s in chosen]))
    return Anatomy(path, len(chosen), *[mean(column) for column in columns], mean(s.ttft_ms for s in chosen))


def measure_extra(server: FigureServer, counter: TokenCounter, config: FiguresConfig) -> list[Sample]:
    """`exact` and `rebuild` samples at the representative length (figure a supplies the other paths)."""
    samples = []
    for repetition in range(config.repetitions):
        for sample in (probes.positioned(server, counter, "b", config.anatomy_length, "exact", config.gap_s),
                       probes.rebuild(server, counter, "b", config.anatomy_length, config.gap_s)):
            samples.append(sample)
            progress("[b] entry %d tokens, served %-7s: TTFT %.1f ms (rep %d/%d)", config.anatomy_length,
                     sample.path, sample.ttft_ms, repetition + 1, config.repetitions)
    return samples


def plot(anatomies: list[Anatomy], length: int, png: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 5))
    labels = [f"{a.path}\n(n={a.num_samples})" for a in anatomies]
    bottoms = [0.0] * len(anatomies)
    for index, (part, color) in enumerate(zip(PARTS, PART_COLORS)):
        heights = [a.parts()[index] for a in anatomies]
        axis.bar(labels, heights, bottom=bottoms, color=color, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        axis.annotate(f"{total:.1f} ms", (x, total), ha="center", va="bottom", fontsize=8)
    axis.set_yscale("symlog", linthresh=1)
    axis.set_ylabel("mean first-token time, client (ms; linear below 1, log above)")
    axis.set_xlabel("served path")
    axis.set_title(f"Cost anatomy of the first token at an entry of {length} tokens")
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)


def run(server: FigureServer, counter: TokenCounter, config: FiguresConfig, entry_samples: list[Sample],
        out: Path) -> FigureOutput:
    samples = [s for s in entry_samples if s.nominal_tokens == config.anatomy_length]
    samples += measure_extra(server, counter, config)
    anatomies = [a for a in (anatomy_of(path, samples) for path in PATHS) if a is not None]
    png, csv_path, samples_csv = out / "b_anatomy.png", out / "b_anatomy.csv", out / "b_anatomy_samples.csv"
    write_csv(csv_path, anatomies)
    write_csv(samples_csv, samples)
    plot(anatomies, config.anatomy_length, png)
    rows = [SummaryRow("b", f"{a.path}: mean client TTFT at entry {config.anatomy_length} tokens (ms)",
                       f"{a.client_ttft_ms:.2f} = queue {a.queue_ms:.2f} + prefill {a.prefill_ms:.1f} + decode "
                       f"{a.decode_ms:.1f} + scan {a.scan_ms:.2f} + other {a.other_server_ms:.2f} + transport "
                       f"{a.transport_ms:.2f} (n={a.num_samples})") for a in anatomies]
    return FigureOutput(png, (csv_path, samples_csv), tuple(rows))
