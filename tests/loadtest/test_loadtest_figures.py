"""The figures: the cost-model fit, the anatomy split, the gate curve and the configuration, without a server;
then `--quick` end to end on the real server (integration)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from prepos_loadtest.figures import anatomy, entry_length, gate_curve
from prepos_loadtest.figures.common import FiguresConfig, Sample
from prepos.metrics import metric_sum

LOADTEST_DIR = Path(__file__).resolve().parents[2] / "loadtest"


def sample(path: str, ttft_ms: float, prefill_tokens: int = 0, **timings) -> Sample:
    fields = {"first_token_ms": None, "queue_ms": None, "prefill_ms": None, "decode_ms": None, "scan_ms": None}
    fields.update(timings)
    return Sample("a", "prepos", 64, 64, prefill_tokens, path, ttft_ms, total_ms=ttft_ms, confidence=None, answer="",
                  **fields)


def test_fit_recovers_the_coefficients_of_exact_data():
    c0, c_pass, c_prefill, c_scan = 1.5, 30.0, 2.5, 0.75
    samples = [sample("prefix", c0 + c_pass + c_prefill * n, n) for n in (80, 150, 300, 600)]
    samples += [sample("prepaid", c0 + c_pass + c_prefill * 20, 20)]
    samples += [sample("gated", c0 + c_scan) for _ in range(3)]
    floors = [sample("floor", c0 + d) for d in (-0.1, 0.0, 0.1)]  # median is c0

    model = entry_length.fit(samples, floors, decode_step_ms=31.0)

    assert model.c0_ms == pytest.approx(c0)
    assert model.c_pass_ms == pytest.approx(c_pass)
    assert model.c_prefill_ms_per_token == pytest.approx(c_prefill)
    assert model.c_scan_ms == pytest.approx(c_scan)
    assert model.c_decode_ms_per_step == 31.0
    assert model.num_points == 8 and model.rms_residual_ms == pytest.approx(0.0, abs=1e-9)
    assert model.predict(100, scan_only=False) == pytest.approx(c0 + c_pass + c_prefill * 100)
    assert model.predict(0, scan_only=True) == pytest.approx(c0 + c_scan)


def test_anatomy_parts_add_up_to_the_client_ttft():
    samples = [sample("prepaid", 200.0, 20, first_token_ms=195.0, queue_ms=1.0, prefill_ms=180.0, decode_ms=0.0,
                      scan_ms=2.0),
               sample("prepaid", 100.0, 20, first_token_ms=96.0, queue_ms=0.0, prefill_ms=90.0, decode_ms=0.0,
                      scan_ms=1.0),
               sample("exact", 3.0, first_token_ms=0.5, queue_ms=0.1, scan_ms=0.3)]
    prepaid = anatomy.anatomy_of("prepaid", samples)
    assert prepaid.num_samples == 2
    assert prepaid.prefill_ms == pytest.approx(135.0)
    assert prepaid.other_server_ms == pytest.approx((12.0 + 5.0) / 2)
    assert prepaid.transport_ms == pytest.approx((5.0 + 4.0) / 2)
    assert sum(prepaid.parts()) == pytest.approx(prepaid.client_ttft_ms) == pytest.approx(150.0)
    assert anatomy.anatomy_of("rebuild", samples) is None


def point(confidence: float, agreed: bool, answer: str = "a", expected: str | None = "a"):
    return gate_curve.DecisionPoint("s", 1, 3, "gated", confidence, answer, "prepaid", answer if agreed else "b",
                                    expected, agreed)


def test_gate_curve_coverage_and_precision_by_threshold():
    points = [point(0.95, True), point(0.6, True), point(0.6, False, answer="c"), point(0.2, False, answer="c")]
    curve = {p.threshold: p for p in gate_curve.curve(points)}
    assert curve[0.0].coverage == 1.0 and curve[0.0].precision == 0.5 and curve[0.0].accuracy_vs_expected == 0.5
    assert curve[0.5].coverage == 0.75 and curve[0.5].precision == pytest.approx(2 / 3)
    assert curve[0.9].coverage == 0.25 and curve[0.9].precision == 1.0
    assert curve[1.0].coverage == 0.0 and math.isnan(curve[1.0].precision)
    coverages = [p.coverage for p in gate_curve.curve(points)]
    assert coverages == sorted(coverages, reverse=True)
    # a threshold that covered no point has no precision: the summary says "-" (it wrote nan)
    rows = {row.quantity: row.value for row in gate_curve.summary_rows(gate_curve.curve([point(0.6, True)]), 1, 2)}
    assert rows["decision points (answered from a positioned state / not)"] == "1 / 2"
    assert rows["threshold 0.5: coverage, precision vs full path"] == "1.00, 1.00 (1 covered)"
    assert rows["threshold 0.9: coverage, precision vs full path"] == "0.00, - (0 covered)"
    rows = {row.quantity: row.value for row in gate_curve.summary_rows(gate_curve.curve([]), 0, 5)}
    assert rows["threshold 0.5: coverage, precision vs full path"] == "-, - (0 covered)"


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="anatomy_length"):
        FiguresConfig(entry_lengths=(64, 128), anatomy_length=256)
    with pytest.raises(ValueError, match="ratios"):
        FiguresConfig(ratios=(0.0, 1.0))
    with pytest.raises(ValueError, match="bfcl_turns"):
        FiguresConfig(bfcl_turns=0)
    assert FiguresConfig.quick().anatomy_length in FiguresConfig.quick().entry_lengths


def test_metric_sum_matches_name_and_labels_exactly():
    text = "\n".join([
        "# HELP prepos_kv_bytes KV cache bytes",
        'prepos_kv_bytes{model="prepos"} 100',
        'prepos_kv_bytes{model="prepos_prefix"} 20',
        'prepos_kv_bytes_total{model="prepos"} 7',
        'prepos_engine_seconds_total{model="prepos",where="background"} 1.5',
        'prepos_engine_seconds_total{model="prepos",where="foreground"} 4',
    ])
    assert metric_sum(text, "prepos_kv_bytes") == 120
    assert metric_sum(text, "prepos_kv_bytes", model="prepos") == 100
    assert metric_sum(text, "prepos_engine_seconds_total", where="background") == 1.5
    assert metric_sum(text, "prepos_missing") == 0


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.integration
def test_quick_run_writes_every_figure_from_the_real_server(tmp_path):
    done = subprocess.run([sys.executable, "-m", "prepos_loadtest.figures", "--quick", "--out", str(tmp_path)],
                          cwd=LOADTEST_DIR, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "figures: [a]" in done.stderr and "figures: [d]" in done.stderr  # progress lines

    for name in ("a_entry_length", "b_anatomy", "c_amortized", "d_gate_curve"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
        assert read_csv(tmp_path / f"{name}.csv"), name

    points = read_csv(tmp_path / "a_entry_length.csv")
    assert {"prefix", "prepaid", "gated"} <= {row["path"] for row in points}
    assert all(float(row["ttft_ms"]) >= float(row["first_token_ms"]) for row in points)
    coefficients = {row["coefficient"]: float(row["value"]) for row in read_csv(tmp_path / "a_cost_model.csv")}
    assert set(coefficients) >= {"c0_ms", "c_pass_ms", "c_prefill_ms_per_token", "c_scan_ms", "c_decode_ms_per_step"}
    assert all(math.isfinite(value) for value in coefficients.values())

    assert {row["path"] for row in read_csv(tmp_path / "b_anatomy.csv")} == set(anatomy.PATHS)

    ratios = read_csv(tmp_path / "c_amortized.csv")
    baseline = [row for row in ratios if row["model"] == "prepos_prefix"]
    assert baseline and all(float(row["background_engine_ms_per_query"]) == 0 for row in baseline)
    assert all(float(row["exact_share"]) == 0 for row in baseline)
    assert any(float(row["background_engine_ms_per_query"]) > 0 for row in ratios if row["model"] == "prepos")

    curve = read_csv(tmp_path / "d_gate_curve.csv")
    coverages = [float(row["coverage"]) for row in curve]
    assert coverages[0] == 1.0 and coverages == sorted(coverages, reverse=True)

    throughput = {row["model"]: row for row in read_csv(tmp_path / "throughput.csv")}
    assert float(throughput["prepos_prefix"]["no_forward_pass_share"]) == 0
    assert int(throughput["prepos"]["num_failed"]) == 0 and int(throughput["prepos_prefix"]["num_failed"]) == 0

    summary = (tmp_path / "summary.md").read_text()
    for figure in ("a", "b", "c", "d", "throughput"):
        assert f"\n| {figure} | " in summary, figure
