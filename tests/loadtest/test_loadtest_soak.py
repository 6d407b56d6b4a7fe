"""The soak's summary, plot, options and process-tree memory, without a server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prepos_loadtest.soak import COLUMNS, SoakOptions, parse_server
from prepos_loadtest.soak import main as soak_main
from prepos_loadtest.soak_probe import tree_memory
from prepos_loadtest.soak_report import summarize, write_plot

LOADTEST_DIR = Path(__file__).resolve().parents[2] / "loadtest"


def write_samples(path: Path, rows: list[dict]) -> None:
    lines = [",".join(COLUMNS)]
    for row in rows:
        lines.append(",".join(str(row.get(column, "")) for column in COLUMNS))
    path.write_text("\n".join(lines) + "\n")


def samples(rss: list[float], errors: list[int], every_s: float = 30.0) -> list[dict]:
    return [{"elapsed_s": every_s * i, "rss_mib": value, "num_processes": 2, "kv_mib": 10.0 + i, "kv_budget_mib": 6000,
             "sessions_open": 4 + i, "requests_total": 100 * i, "request_errors_total": error,
             "engine_foreground_s": 1.0, "engine_background_s": 0.5}
            for i, (value, error) in enumerate(zip(rss, errors))]


def test_summary_takes_rss_after_warm_up_and_its_trend(tmp_path):
    path = tmp_path / "soak.csv"
    write_samples(path, samples([900, 1500, 1600, 1610, 1620], [3, 3, 3, 4, 5], every_s=60.0))
    options = SoakOptions(users=4, duration="4m")
    summary = summarize(path, 120.0, {"num_requests": 400, "num_failed": 0, "exceptions": []}, 0, options)

    assert (summary.rss_start_mib, summary.rss_end_mib, summary.rss_peak_mib) == (1600, 1620, 1620)
    # Samples at 120, 180, 240 s: 1600, 1610, 1620 MiB, i.e. 10 MiB per minute.
    assert summary.rss_slope_mib_per_h == pytest.approx(600.0)
    assert (summary.kv_start_mib, summary.kv_end_mib, summary.kv_peak_mib) == (12.0, 14.0, 14.0)
    assert summary.server_errors == 2 and summary.sessions_peak == 8 and summary.num_samples == 5
    assert summary.sessions_at_start == 4
    assert "| open sessions, at the first sample / peak | 4 / 8 |" in summary.markdown()
    assert summary.passed
    assert "0 errors" in summary.line() and "1600 MiB -> end 1620 MiB" in summary.line()
    assert "| server RSS after warm-up / at end / peak (MiB) | 1600.0 / 1620.0 / 1620.0 |" in summary.markdown()

    write_plot(path, tmp_path / "soak.png", 120.0, summary)
    assert (tmp_path / "soak.png").read_bytes()[:4] == b"\x89PNG"


def test_a_run_that_ended_within_its_warm_up_is_summed_up_over_all_its_samples_and_says_so(tmp_path):
    """Interrupted 20 s into a 60 s warm-up, a soak reported its last sample alone, taken after every session had
    closed, as the RSS and KV after warm-up, at end and peak."""
    path = tmp_path / "soak.csv"
    write_samples(path, samples([1440, 1458, 1450, 1439], [0, 0, 0, 0], every_s=5.0))  # 15 s in all
    options = SoakOptions(users=4, duration="2m")
    summary = summarize(path, 60.0, {"num_requests": 10, "num_failed": 0, "exceptions": [], "interrupted": True}, 0,
                        options, num_missed=2)
    assert summary.ended_in_warmup and summary.interrupted
    assert (summary.rss_start_mib, summary.rss_end_mib, summary.rss_peak_mib) == (1440, 1439, 1458)
    assert (summary.kv_start_mib, summary.kv_end_mib, summary.kv_peak_mib) == (10.0, 13.0, 13.0)
    assert summary.rss_slope_mib_per_h is None
    markdown = summary.markdown()
    assert ("| server RSS at the first sample (the run ended within its warm-up) / at end / peak (MiB) | "
            "1440.0 / 1439.0 / 1458.0 |") in markdown
    assert "| samples | 4 (2 missed: the metrics endpoint was unreadable then) |" in markdown
    assert "server RSS at the first sample (the run ended within its warm-up) 1440 MiB -> end 1439 MiB (peak 1458 " \
        "MiB" in summary.line()
    assert "(2 samples missed" in summary.line()
    after = summarize(path, 5.0, {"num_requests": 10, "num_failed": 0, "exceptions": []}, 0, options)
    assert not after.ended_in_warmup and after.rss_start_mib == 1458 and "after warm-up 1458 MiB" in after.line()
    assert "| samples | 4 |" in after.markdown()


def test_a_failed_request_or_no_request_fails_the_soak(tmp_path):
    path = tmp_path / "soak.csv"
    write_samples(path, samples([1000, 1000], [0, 0]))
    options = SoakOptions(users=1, duration="1m")
    failed = summarize(path, 10.0, {"num_requests": 10, "num_failed": 1, "exceptions": []}, 0, options)
    assert not failed.passed and failed.num_errors == 1
    raised = summarize(path, 10.0, {"num_requests": 10, "num_failed": 0, "exceptions": [{"Count": "1"}]}, 0, options)
    assert not raised.passed
    assert not summarize(path, 10.0, {}, 0, options).passed  # Locust wrote no summary: nothing was measured


def test_a_short_run_draws_no_trend_and_a_run_without_samples_does_not_pass(tmp_path):
    """A 30-second soak reported "trend +2646 MiB/h" from a few seconds after warm-up; one whose metrics endpoint
    was wrong passed with an empty CSV."""
    path = tmp_path / "soak.csv"
    write_samples(path, samples([1000, 1010, 1020, 1030], [0, 0, 0, 0], every_s=10.0))  # 30 s in all
    options = SoakOptions(users=1, duration="30s")
    short = summarize(path, 0.0, {"num_requests": 10, "num_failed": 0, "exceptions": []}, 0, options)
    assert short.rss_slope_mib_per_h is None and "trend -" in short.line() and short.passed
    write_samples(path, [])
    empty = summarize(path, 0.0, {"num_requests": 10, "num_failed": 0, "exceptions": []}, 0, options)
    assert not empty.passed and "no sample: the metrics endpoint was never read" in empty.line()


def test_a_metrics_url_that_is_unreadable_or_no_prepos_servers_is_refused_before_any_load(capsys, tmp_path,
                                                                                            monkeypatch):
    import http.server
    import threading

    class NotPrepos(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"nv_inference_count 3\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    monkeypatch.chdir(tmp_path)
    other = http.server.HTTPServer(("127.0.0.1", 0), NotPrepos)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        for url, says in ((f"http://127.0.0.1:{other.server_port}/metrics", "no prepos metrics there"),
                          ("http://127.0.0.1:9/metrics", "cannot read it"),
                          ("http://127.0.0.1:80x/metrics", "cannot read it (InvalidURL")):
            with pytest.raises(SystemExit) as exited:
                soak_main(["--server", "127.0.0.1:9", "--metrics-url", url, "--out", str(tmp_path / "out")])
            assert exited.value.code == 2
            assert f"--metrics-url {url}: {says}" in capsys.readouterr().err
    finally:
        other.shutdown()
        other.server_close()
    assert not (tmp_path / "out").exists()


def test_an_interrupted_soak_says_so_and_how_long_it_ran(tmp_path):
    path = tmp_path / "soak.csv"
    write_samples(path, samples([1000, 1010, 1020], [0, 0, 0]))  # samples at 0, 30 and 60 s
    options = SoakOptions(users=2, duration="10m")
    summary = summarize(path, 10.0, {"num_requests": 40, "num_failed": 0, "exceptions": [], "interrupted": True},
                        130, options)
    assert summary.interrupted and summary.duration_s == 60.0 and not summary.passed
    assert "for 1.0 min (interrupted)" in summary.line()
    assert "| duration | 1.0 min, interrupted (warm-up 10 s) |" in summary.markdown()
    whole = summarize(path, 10.0, {"num_requests": 40, "num_failed": 0, "exceptions": []}, 0, options)
    assert not whole.interrupted and whole.duration_s == 600.0


def test_options_name_the_field_they_reject():
    with pytest.raises(ValueError, match="users"):
        SoakOptions(users=0)
    with pytest.raises(ValueError, match="run-time"):
        SoakOptions(duration="ten minutes")
    with pytest.raises(ValueError, match="workload: expected one of bfcl, chat, monitor, got 'trace'"):
        SoakOptions(workload="trace")  # the soak has no --trace to give it
    with pytest.raises(ValueError, match="sample_interval_s"):
        SoakOptions(sample_interval_s=0)
    with pytest.raises(ValueError, match="sample_interval_s: must be a finite number"):
        SoakOptions(sample_interval_s=float("inf"))
    assert SoakOptions(duration="10m", warmup_s=60).effective_warmup_s == 60
    assert SoakOptions(duration="1m", warmup_s=60).effective_warmup_s == 30


def test_usage_errors_exit_2_naming_the_flag():
    done = subprocess.run([sys.executable, "-m", "prepos_loadtest.soak", "--duration", "soon"], cwd=LOADTEST_DIR,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--duration" in done.stderr


@pytest.mark.parametrize(("argv", "named"), [
    (["--server", "nonsense"], "--server"),
    (["--server", "127.0.0.1:0"], "--server"),
    (["--server", ":8001"], "--server"),
    (["--server", "127.0.0.1:1", "--server-pid", "-5"], "--server-pid"),
    (["--server", "127.0.0.1:1", "--server-pid", "abc"], "--server-pid"),
    (["--server", "127.0.0.1:1", "--metrics-url", "ftp://host/metrics"], "--metrics-url"),
    (["--server-pid", str(os.getpid())], "--server"),
    (["--metrics-url", "http://127.0.0.1:8002/metrics"], "--server"),
    (["--server", "127.0.0.1:1", "--out", __file__], "--out"),
])
def test_bad_server_arguments_are_refused_before_any_load(argv, named, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        soak_main(argv)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


def test_a_server_pid_must_name_a_running_process(capsys):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    with pytest.raises(SystemExit):
        soak_main(["--server", "127.0.0.1:1", "--server-pid", str(child.pid)])
    assert f"no process with id {child.pid}" in capsys.readouterr().err


def test_server_addresses_keep_host_and_port():
    assert parse_server("grpc://127.0.0.1:8001/") == "127.0.0.1:8001"
    assert parse_server("[::1]:8001") == "[::1]:8001"


def test_tree_memory_counts_the_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = b'1' * (64 << 20); time.sleep(30)"])
    try:
        for _ in range(200):  # until the child holds its 64 MiB
            own = tree_memory(child.pid)
            if own.rss_bytes >= 64 << 20:
                break
            time.sleep(0.05)
        memory = tree_memory(os.getpid())
        assert memory.num_processes == 2
        assert own.rss_bytes >= 64 << 20 and memory.rss_bytes > own.rss_bytes
    finally:
        child.kill()
        child.wait()
    assert tree_memory(child.pid) is None
