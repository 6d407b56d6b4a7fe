"""From calibration records to a certified gate: threshold choice, held-out check, report files.

Sessions are split by a hash of their name into a calibration part and a
held-out part (no session in both). On the calibration part every candidate —
a gate score (``p_max``, ``margin``, ``certainty``) with a speculative delta
variant (empty, or a placeholder) — gets the largest-coverage threshold whose
false-accept rate is certified at most ``epsilon``
(:func:`prepos.risk.select_threshold`). Choosing the best candidate after
looking is itself a multiple test, so each candidate is certified at
``delta / number of candidates`` (Bonferroni): the chosen candidate's
certificate holds at confidence ``1 - delta``. The held-out part then gives the
observed false-accept rate of the chosen gate with its Clopper–Pearson
interval, an independent check.

Files written by :func:`write_report` under the output directory:
``report.md``, ``risk_coverage.csv``, ``risk_coverage.png`` and one
``gate_eps<epsilon>.pbtxt`` config fragment per epsilon (``parameters``
entries the model repository's ``config.pbtxt`` takes).
"""

from __future__ import annotations

import csv
import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from prepos.calibration import EMPTY, DecisionRecord
from prepos.gate import GATE_SCORES
from prepos.risk import RiskControlResult, clopper_pearson_interval, select_threshold
from prepos.scan import ScanResult

log = logging.getLogger("prepos.calibration")

SCORES = tuple(GATE_SCORES)  # every score the server's gate can use


@dataclass(frozen=True)
class HeldOutCheck:
    """The chosen gate on held-out sessions: answers accepted, false accepts, rate and interval."""

    num_points: int
    num_accepted: int
    num_errors: int
    rate: float  # false accepts / accepted (0 when none)
    interval: tuple[float, float]  # two-sided Clopper–Pearson at the report's confidence
    coverage: float


@dataclass(frozen=True)
class CandidateResult:
    """One score and speculative-delta variant at one epsilon, calibrated and checked."""

    score: str
    variant: str
    calibration: RiskControlResult
    held_out: HeldOutCheck
    agreement_rate: float  # calibration part: speculative first token equals the full path's, all points
    aurc: float  # calibration part: area under the observed risk–coverage curve (lower ranks errors better)


@dataclass(frozen=True)
class EpsilonResult:
    """All candidates at one epsilon and the chosen one (None = gate off)."""

    epsilon: float
    delta: float
    candidates: tuple[CandidateResult, ...]
    chosen: CandidateResult | None
    method: str = "bonferroni"  # how each candidate's grid of thresholds was tested (prepos.risk.METHODS)


def split_sessions(records: Sequence[DecisionRecord], held_out_fraction: float, seed: str = "prepos") \
        -> tuple[list[DecisionRecord], list[DecisionRecord]]:
    """(calibration, held-out) records; a session lands wholly in one part, by a hash of its name and ``seed``."""
    if not 0.0 <= held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction: must lie in [0, 1), got {held_out_fraction}")
    cal, held = [], []
    for record in records:
        digest = hashlib.blake2b(f"{seed}:{record.session}".encode(), digest_size=8).digest()
        (held if int.from_bytes(digest, "little") / 2**64 < held_out_fraction else cal).append(record)
    return cal, held


def _score(record: DecisionRecord, variant: str, score: str) -> float:
    # The server's own scoring strategy on the recorded scan features.
    f = record.variants[variant]
    return GATE_SCORES[score]().score(ScanResult(f.token_id, f.p_max, f.margin, f.entropy, f.num_allowed))


def aurc(scores: Sequence[float], agreed: Sequence[bool]) -> float:
    """Area under the risk–coverage curve: the false-accept rate among the answers accepted at each
    distinct score (highest first), weighted by the coverage each adds. Tied scores are accepted together,
    as a threshold must. Lower is better; its floor, reached when every error scores lowest, depends on
    the number of errors."""
    by_score: dict[float, list[int]] = {}
    for score, ok in zip(scores, agreed):
        counts = by_score.setdefault(score, [0, 0])
        counts[0] += 1
        counts[1] += not ok
    accepted = errors = 0
    area = 0.0
    for score in sorted(by_score, reverse=True):
        num, num_errors = by_score[score]
        accepted += num
        errors += num_errors
        area += num * errors / accepted
    return area / accepted if accepted else 0.0


def _held_out(records: Sequence[DecisionRecord], variant: str, score: str, threshold: float | None,
              delta: float) -> HeldOutCheck:
    accepted = [r for r in records if threshold is not None and _score(r, variant, score) >= threshold]
    k = sum(not r.variants[variant].agreed for r in accepted)
    n = len(accepted)
    interval = clopper_pearson_interval(k, n, delta) if n else (0.0, 1.0)
    return HeldOutCheck(len(records), n, k, k / n if n else 0.0, interval, n / len(records) if records else 0.0)


def recorded_variants(records: Sequence[DecisionRecord]) -> list[str]:
    """The speculative deltas ``records`` hold, the empty delta first (every record holds the same ones)."""
    return [EMPTY, *sorted(v for v in records[0].variants if v != EMPTY)] if records else []


def calibrate(records: Sequence[DecisionRecord], *, epsilons: Sequence[float], delta: float,
              held_out_fraction: float = 0.5, method: str = "bonferroni",
              scores: Sequence[str] = SCORES, variants: Sequence[str] | None = None) -> list[EpsilonResult]:
    """Calibrate every score and variant at each epsilon; choose the largest certified coverage.

    ``variants`` limits the speculative deltas compared (default: all recorded).
    Fewer candidates fixed in advance give a tighter certificate (each is
    tested at ``delta / number of candidates``). Ties go to the earlier score
    in ``scores`` and to the empty delta. Raises ``ValueError`` naming the
    argument when there are no calibration records or an unknown score or variant.
    """
    if not records:
        raise ValueError("records: no decision point recorded")
    cal, held = split_sessions(records, held_out_fraction)
    if not cal:  # sessions are split whole, by their name: few sessions can all land in the held-out part
        raise ValueError(f"records: the {len(records)} decision points (of {len({r.session for r in held})} "
                         "sessions) all fell in the held-out part; more sessions needed")
    unknown = [s for s in scores if s not in GATE_SCORES]
    if unknown or not scores:
        raise ValueError(f"scores: unknown {unknown or 'empty'}; known: {', '.join(GATE_SCORES)}")
    recorded = recorded_variants(cal)
    unknown = sorted(set(variants or ()) - set(recorded))
    if unknown or variants is not None and not variants:
        raise ValueError(f"variants: {', '.join(map(repr, unknown)) or 'none'} not recorded; recorded: "
                         f"{', '.join(recorded)}")
    variants = recorded if variants is None else [v for v in recorded if v in variants]
    candidates = [(s, v) for v in variants for s in scores]
    results = []
    for epsilon in epsilons:
        rows = []
        for score, variant in candidates:
            result = select_threshold([_score(r, variant, score) for r in cal],
                                      [r.variants[variant].agreed for r in cal],
                                      epsilon=epsilon, delta=delta / len(candidates), method=method)
            agreement = sum(r.variants[variant].agreed for r in cal) / len(cal)
            rows.append(CandidateResult(score, variant, result, _held_out(held, variant, score, result.threshold, delta),
                                        agreement, aurc([_score(r, variant, score) for r in cal],
                                                        [r.variants[variant].agreed for r in cal])))
        open_rows = [r for r in rows if not r.calibration.gate_off]
        chosen = max(open_rows, key=lambda r: r.calibration.coverage, default=None)
        results.append(EpsilonResult(epsilon, delta, tuple(rows), chosen, method))
    return results


def pbtxt_string(text: str) -> str:
    """``text`` as the inside of a protobuf text-format string: a backslash, a quote and every control character
    escaped (a newline left as it is would cut the fragment's line in two, which Triton refuses), the rest kept
    as it is (protobuf reads UTF-8 there)."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(escapes.get(char) or (f"\\{ord(char):03o}" if ord(char) < 0x20 or ord(char) == 0x7F else char)
                   for char in text)


def config_fragment(result: EpsilonResult, placeholders: dict[str, str]) -> str:
    """``parameters`` entries for ``config.pbtxt``: the chosen gate, or the gate off when none qualifies.

    Each line is a whole ``parameters { ... }`` field, which protobuf text format takes anywhere at the top level
    of the file (outside ``parameters [ ... ]``, whose entries need a comma between them and none after the last,
    so that no line form fits both the middle and the end of that list): the lines replace the gate lines of the
    shipped config.pbtxt, which have that form (of a key set twice, Triton takes the later entry).
    """

    def line(key: str, value: object) -> str:
        return f'parameters {{ key: "{key}" value: {{ string_value: "{pbtxt_string(str(value))}" }} }}'

    head = f"# prepos calibrate: epsilon {result.epsilon:g}, confidence {1 - result.delta:g}"
    where = "# these lines replace the gate lines of config.pbtxt (parameters { ... } fields, after its list)"
    chosen = result.chosen
    if chosen is None:
        return "\n".join([head + ": gate off (no threshold certified)", where, line("gate.speculate", "false"),
                          line("gate.epsilon", result.epsilon), line("gate.confidence", 1 - result.delta),
                          line("gate.calibrated_coverage", 0.0)]) + "\n"
    cal = chosen.calibration
    spec = "" if chosen.variant == EMPTY else placeholders[chosen.variant]
    return "\n".join([
        head, where, line("gate.speculate", "true"), line("gate.score", chosen.score),
        line("gate.threshold", repr(cal.threshold)), line("gate.speculative_delta", spec),
        line("gate.epsilon", result.epsilon), line("gate.confidence", 1 - result.delta),
        line("gate.calibrated_coverage", f"{cal.coverage:.4f}"),
    ]) + "\n"


def _write_csv(path: Path, results: Sequence[EpsilonResult]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epsilon", "score", "variant", "threshold", "num_accepted", "num_errors", "coverage",
                         "risk", "bound", "certified"])
        for res in results:
            for cand in res.candidates:
                for p in cand.calibration.curve:
                    writer.writerow([res.epsilon, cand.score, cand.variant, p.threshold, p.num_accepted,
                                     p.num_errors, f"{p.coverage:.6f}", f"{p.risk:.6f}", f"{p.bound:.6f}",
                                     int(p.certified)])


def _write_png(path: Path, results: Sequence[EpsilonResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cand in first.candidates:
        curve = [p for p in cand.calibration.curve if p.num_accepted]
        label = f"{cand.score} ({cand.variant})"
        line, = ax.plot([p.coverage for p in curve], [p.risk for p in curve], marker=".", label=label + " observed")
        ax.plot([p.coverage for p in curve], [p.bound for p in curve], ls=":", color=line.get_color())
    for res in results:
        ax.axhline(res.epsilon, color="grey", lw=0.8, ls="--")
        ax.text(0.01, res.epsilon, f" epsilon {res.epsilon:g}", va="bottom", fontsize=8, color="grey")
        if res.chosen:
            c = res.chosen.calibration
            ax.plot([c.coverage], [c.bound], marker="*", ms=12, color="black")
    ax.set_xlabel("coverage (share of decision points the gate answers)")
    ax.set_ylabel("false-accept rate among answered")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    level = "fixed-sequence" if first.method == "fixed_sequence" else "Bonferroni"
    ax.set_title(title + f"\nsolid: observed; dotted: upper bound ({level} level); star: chosen", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _markdown(results: Sequence[EpsilonResult], records: Sequence[DecisionRecord], title: str,
              placeholders: dict[str, str], held_out_fraction: float) -> str:
    cal, held = split_sessions(records, held_out_fraction)
    lines = [f"# Gate calibration: {title}", "",
             f"{len(records)} decision points from {len({r.session for r in records})} sessions: "
             f"{len(cal)} calibration ({len({r.session for r in cal})} sessions), {len(held)} held out "
             f"({len({r.session for r in held})} sessions, disjoint).",
             "Speculative delta variants: " + ", ".join(
                 [f"`{EMPTY}`"] + [f"`{k}` = {v!r}" for k, v in sorted(placeholders.items())]) + ".", ""]
    for res in results:
        conf = 1 - res.delta
        lines += [f"## epsilon {res.epsilon:g}, confidence {conf:g}", ""]
        if res.chosen is None:
            lines += ["**Gate off**: no score, variant and threshold certifies a false-accept rate at most "
                      f"{res.epsilon:g} with confidence {conf:g}. The fragment sets `gate.speculate` false.", ""]
        else:
            c, h = res.chosen.calibration, res.chosen.held_out
            lines += [f"**Chosen**: score `{res.chosen.score}`, delta `{res.chosen.variant}`, threshold "
                      f"{c.threshold:.6g}: calibration coverage {c.coverage:.3f} ({c.num_accepted}/{c.num_points}), "
                      f"{c.num_errors} false accepts, certified bound {c.bound:.4f}.",
                      f"Held out: {h.num_accepted}/{h.num_points} answered (coverage {h.coverage:.3f}), "
                      + (f"{h.num_errors} false accepts, observed rate {h.rate:.4f}, "
                         f"{conf:.0%} interval [{h.interval[0]:.4f}, {h.interval[1]:.4f}]." if h.num_accepted else
                         "no false-accept rate to observe (--held-out 0, or the threshold answered none)."), ""]
        lines += ["| score | delta | agreement (calibration part, no threshold) | AURC | threshold | coverage | "
                  "false accepts | bound | lowest bound on the grid (its coverage) | held-out coverage | "
                  "held-out rate [interval] |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for cand in res.candidates:
            c, h = cand.calibration, cand.held_out
            thr = "gate off" if c.gate_off else f"{c.threshold:.6g}"
            held_rate = "-" if c.gate_off or not h.num_accepted else \
                f"{h.rate:.4f} [{h.interval[0]:.4f}, {h.interval[1]:.4f}]"
            low = min(c.curve, key=lambda p: (p.bound, -p.coverage))
            lines.append(f"| {cand.score} | {cand.variant} | {cand.agreement_rate:.3f} | {cand.aurc:.4f} | {thr} | "
                         f"{c.coverage:.3f} | "
                         f"{c.num_errors}/{c.num_accepted} | {c.bound:.4f} | {low.bound:.4f} ({low.coverage:.3f}) | "
                         f"{h.coverage:.3f} | {held_rate} |")
        lines.append("")
    num = len(results[0].candidates) if results else 0
    if results and results[0].method == "fixed_sequence":
        how = (f"Each of the {num} candidates is tested at delta / {num}: its thresholds one by one from the highest "
               "(fixed-sequence testing over a fixed grid, prepos.risk), each at that level, stopping at the first "
               "not certified: its bound above epsilon, or no answer at or above it. A lower bound past that point "
               "certifies nothing (the lowest bound on the grid can lie below epsilon where the gate is off), so "
               "the chosen one's bound holds at the stated confidence. ")
    else:
        how = (f"Each of the {num} candidates is certified at delta / {num} with Bonferroni over a fixed grid of "
               "thresholds (prepos.risk), so the chosen one's bound holds at the stated confidence. ")
    lines += [how +
              "Agreement: the share of the calibration part's decision points, every one (no threshold), where the "
              "speculative first decision token equals the full path's. AURC: area under the observed "
              "risk–coverage curve on the calibration part, uncertified; it ranks scores and variants even where "
              "none certifies.", ""]
    return "\n".join(lines)


_FRAGMENT_NAME = re.compile(r"gate_eps(\d+(\.\d*)?|\.\d+)(e-?\d+)?\.pbtxt")  # as written: f"{epsilon:g}"


def write_report(out_dir: str | Path, records: Sequence[DecisionRecord], results: Sequence[EpsilonResult], *,
                 title: str, placeholders: dict[str, str], held_out_fraction: float) -> list[Path]:
    """Write the report files (see the module docstring); return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.md", out / "risk_coverage.csv", out / "risk_coverage.png"]
    paths[0].write_text(_markdown(results, records, title, placeholders, held_out_fraction), encoding="utf-8")
    _write_csv(paths[1], results)
    _write_png(paths[2], results, title)
    for res in results:
        fragment = out / f"gate_eps{res.epsilon:g}.pbtxt"
        fragment.write_text(config_fragment(res, placeholders), encoding="utf-8")
        paths.append(fragment)
    for stale in sorted(set(out.glob("gate_eps*.pbtxt")) - set(paths)):
        # an earlier report's, for an epsilon this one did not certify: it would sit beside this report, from
        # other records or another method, as if it were one of its own (a file of the user's, named otherwise,
        # stays)
        if not _FRAGMENT_NAME.fullmatch(stale.name):
            continue
        stale.unlink()
        log.info("removed %s, an earlier report's fragment for an epsilon this report does not cover", stale)
    return paths
