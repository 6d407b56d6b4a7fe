"""`python -m prepos_loadtest.run` without a server: run-time parsing, reading Locust's CSVs, the verdict, usage."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from prepos_loadtest import run
from prepos_loadtest.run import LoadTestResult, StatsRow, parse_run_time, passed, read_results, summary_lines

STATS_HEADER = ("Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
                "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
                "99.99%,100%")


def stats_line(kind, name, count, failures, average, p50, p90, p99, maximum, tokens):
    return (f"{kind},{name},{count},{failures},{p50},{average},1,{maximum},{tokens},1.0,0.0,{p50},{p50},{p50},{p50},"
            f"{p90},{p90},{p99},{p99},{maximum},{maximum},{maximum}")


def write_csvs(prefix, stats_lines, failures=(), exceptions=()):
    (prefix.parent / f"{prefix.name}_stats.csv").write_text("\n".join([STATS_HEADER, *stats_lines]) + "\n")
    (prefix.parent / f"{prefix.name}_failures.csv").write_text(
        "\n".join(["Method,Name,Error,Occurrences,First Seen,Last Seen", *failures]) + "\n")
    (prefix.parent / f"{prefix.name}_exceptions.csv").write_text(
        "\n".join(["Count,Message,Traceback,Nodes", *exceptions]) + "\n")


@pytest.mark.parametrize(("text", "seconds"), [("60", 60), ("60s", 60), ("1m30s", 90), ("2m", 120), ("1h", 3600)])
def test_parse_run_time(text, seconds):
    assert parse_run_time(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "ten", "1.5s", "-3s"])
def test_parse_run_time_rejects(text):
    with pytest.raises(ValueError, match="^--run-time:"):
        parse_run_time(text)


def test_read_results_counts_requests_by_their_total_rows(tmp_path):
    prefix = tmp_path / "loadtest"
    write_csvs(prefix, [
        stats_line("TOTAL", "append", 10, 0, 4.2, 4, 7, 9, 9.5, 0),
        stats_line("TTFT", "prefix", 5, 0, 300.5, 300, 400, 410, 412.0, 3),
        stats_line("TOTAL", "generate", 2, 2, 10.0, 10, 12, 12, 12.0, 0),
        stats_line("TOTAL", "prefix", 5, 0, 900.0, 900, 1000, 1000, 1001.0, 3),
        stats_line("TTFT", "exact", 8, 0, 1.5, 1, 2, 3, 3.2, 1),
        stats_line("", "Aggregated", 30, 2, 300, 300, 1000, 1000, 1001.0, 1),
    ], failures=['TOTAL,generate,"PreposError(\'max_tokens: must be in [0, 4096], got -1\')",2,x,y'])
    result = read_results(prefix)
    assert [(row.path, row.kind) for row in result.rows] == [
        ("exact", "TTFT"), ("prefix", "TTFT"), ("prefix", "TOTAL"), ("append", "TOTAL"), ("generate", "TOTAL")]
    assert (result.num_requests, result.num_failed) == (17, 2)
    assert result.error_rate == pytest.approx(2 / 17)
    assert result.rows[1] == StatsRow("TTFT", "prefix", 5, 0, 300.5, 300, 400, 410, 412.0, 3)
    assert result.failures[0]["Error"] == "PreposError('max_tokens: must be in [0, 4096], got -1')"
    lines = summary_lines(result, max_error_rate=0.01)
    assert any("max_tokens" in line for line in lines)
    assert lines[-1] == "requests 17, failed 2: error rate 11.76% (bound 1.00%): FAIL"
    assert not passed(result, 0.01) and passed(result, 0.2)


def test_na_figures_read_as_nan(tmp_path):
    prefix = tmp_path / "loadtest"
    write_csvs(prefix, [stats_line("TOTAL", "generate", 0, 3, 0, "N/A", "N/A", "N/A", 0, 0)])
    row = read_results(prefix).rows[0]
    assert math.isnan(row.p50_ms) and row.num_failures == 3


def test_no_requests_or_user_exceptions_fail():
    empty = LoadTestResult(rows=(), failures=(), exceptions=(), num_requests=0, num_failed=0)
    assert not passed(empty, 1.0)
    assert summary_lines(empty, 1.0)[-1] == "no request completed: FAIL"
    crashed = LoadTestResult(rows=(), failures=(), exceptions=({"Count": "1", "Message": "boom"},),
                             num_requests=5, num_failed=0)
    assert not passed(crashed, 1.0)
    assert any("boom" in line for line in summary_lines(crashed, 1.0))


def test_locust_command_forwards_the_prepos_options(tmp_path):
    args = run.build_parser().parse_args(["--host", "127.0.0.1:9", "--users", "3", "--run-time", "5s",
                                          "--think-scale", "0.5", "--workload-sessions", "7"])
    command = run.locust_command(args, run.LOCUSTFILES / "chat.py", tmp_path, ["--tags", "x"])
    joined = " ".join(command)
    assert "--headless" in command and "--exit-code-on-error 0" in joined
    assert f"--csv {tmp_path / 'loadtest'}" in joined and f"--html {tmp_path / 'report.html'}" in joined
    assert "--host 127.0.0.1:9" in joined and "--users 3" in joined and "--run-time 5s" in joined
    assert "--think-scale 0.5" in joined and "--workload-sessions 7" in joined
    assert "--think-jitter" not in joined  # defaults are Locust-side defaults too
    assert command[-2:] == ["--tags", "x"]


def test_a_switch_is_forwarded_only_when_it_differs_from_its_default(tmp_path):
    def forwarded(argv: list[str]) -> list[str]:
        args = run.build_parser().parse_args(["--host", "127.0.0.1:9", *argv])
        return run.locust_command(args, run.LOCUSTFILES / "chat.py", tmp_path, [])

    assert "--wait-for-ready" in forwarded(["--wait-for-ready"])
    assert not any("wait-for-ready" in argument for argument in forwarded([]))
    assert not any("wait-for-ready" in argument for argument in forwarded(["--no-wait-for-ready"]))
    assert run.build_parser().parse_args(["--wait-for-ready"]).wait_for_ready is True


def test_every_workload_has_a_task_file():
    stems = {path.stem for path in run.LOCUSTFILES.glob("*.py")}
    assert stems == {"bfcl", "monitor", "chat", "trace"}


@pytest.mark.parametrize("argv", [
    ["--users", "0"], ["--spawn-rate", "0"], ["--max-error-rate", "2"], ["--run-time", "soon"],
    ["--think-scale", "-1"], ["--workload-sessions", "0"], ["--workload", "nope"],
    ["--trace", "/nonexistent/trace.jsonl"],
])
def test_usage_errors_exit_2_before_locust_starts(tmp_path, argv):
    with pytest.raises(SystemExit) as exit_info:
        run.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_only_the_user_module_imports_locust():
    # Importing Locust patches the whole process for gevent: tools and tests must stay free of it.
    code = ("import sys; import prepos_loadtest.run, prepos_loadtest.trace, prepos_loadtest.replay, "
            "prepos_loadtest.options, prepos_loadtest.workloads; "
            "assert not {'locust', 'gevent'} & set(sys.modules), sorted({'locust', 'gevent'} & set(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=run.LOADTEST_DIR, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_an_output_folder_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--host", "127.0.0.1:9", "--out", str(blocker / "out")])
    assert exit_info.value.code == 2
    assert f"--out {blocker / 'out'}: cannot make the output folder" in capsys.readouterr().err
