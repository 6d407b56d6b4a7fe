"""`python -m prepos_loadtest.run` without a server: run-time parsing, reading Locust's CSVs, the verdict, usage."""

from __future__ import annotations

import csv
import json
import math
import signal
import subprocess
import sys
import textwrap
import time

import psutil
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


@pytest.mark.parametrize(("text", "seconds"), [("60", 60), ("60s", 60), ("1m30s", 90), ("2m", 120), ("1h", 3600),
                                               ("86399999913600s", 86_399_999_913_600)])
def test_parse_run_time(text, seconds):
    assert parse_run_time(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "ten", "1.5s", "-3s", "10S", " 5s", "1M", "\uff15",
                                  "99999999999999999999h", "86399999913601s", "23999999999h"])
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
    ["--users", "0"], ["--spawn-rate", "0"], ["--spawn-rate", "inf"], ["--max-error-rate", "2"],
    ["--run-time", "soon"], ["--run-time", "10S"], ["--tls-ca", "/nonexistent/ca.pem"],
    ["--think-scale", "-1"], ["--workload-sessions", "0"], ["--workload", "nope"],
    ["--trace", "/nonexistent/trace.jsonl"], ["--host", ""], ["--host", "127.0.0.1:84237"],
    ["--run-time", "99999999999999999999h"], ["--host", "localhost"], ["--host", "[::1]"],
])
def test_usage_errors_exit_2_before_locust_starts(tmp_path, argv):
    with pytest.raises(SystemExit) as exit_info:
        run.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert not (tmp_path / "out").exists()


def test_a_host_without_a_port_is_refused_naming_it_and_one_with_a_port_is_not(capsys):
    # gRPC took `localhost` as port 443, and every request of the run failed with "connection refused".
    parser = run.build_parser()
    for host in ("localhost", "dns:///localhost", "[::1]"):
        with pytest.raises(SystemExit):
            run._validate(parser.parse_args(["--host", host]), parser)
        assert f"--host: {host!r} names no port, so gRPC would use 443 (TLS)" in capsys.readouterr().err
    for argv in (["--host", "localhost:8001"], ["--host", "[::1]:8001"], ["--host", "unix:/tmp/prepos.sock"],
                 ["--host", "dns:///localhost:8001"], ["--host", "ipv4:127.0.0.1:8001"],
                 ["--host", "prepos.example.com", "--tls"]):  # a TLS endpoint on 443 names none
        run._validate(parser.parse_args(argv), parser)


@pytest.mark.parametrize(("content", "message"), [
    ("", "no step: the file is empty or blank"),
    ("\n   \n", "no step: the file is empty or blank"),
    ('{"session": "s", "delta": "x", "max_tokens": 0, "choices": ["a"]}\n', ":1: choices: expected null on an update"),
    ('{"session": "s", "delta": "x"}\n', ":1: max_tokens: missing"),
])
def test_a_trace_without_steps_or_with_a_bad_one_is_a_usage_error_before_locust_starts(tmp_path, capsys, content,
                                                                                         message):
    """An empty trace started Locust, whose spawner died at once, and the run lasted its whole run time with no
    user before it failed."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--trace", str(trace), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--trace: {trace}" in err and message in err, err
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


# Users that record a request every 20 ms; one that never finishes its task when asked to, for the second interrupt.
INTERRUPTIBLE_USERS = '''
import os, time
from pathlib import Path
import gevent
from locust import User, task, constant

import prepos_loadtest.grpc_user  # noqa: F401  (its hooks: the statistics of an interrupted run)

MARKS = Path(os.environ["MARKS"])

class Steady(User):
    wait_time = constant(0.02)

    def on_start(self):
        (MARKS / f"started-{id(self)}").touch()  # one mark per user

    def on_stop(self):
        (MARKS / "stopped").touch()
        gevent.sleep(float(os.environ.get("SLOW_STOP", "0")))  # an END that takes a while
        self.environment.events.request.fire(request_type="TOTAL", name="close", response_time=1.0,
                                             response_length=0, exception=None, context={})

    @task
    def ask(self):
        if os.environ.get("STUCK"):
            gevent.sleep(3600)
        self.environment.events.request.fire(request_type="TOTAL", name="gated", response_time=1.0,
                                             response_length=1, exception=None, context={})
'''


@pytest.fixture
def loadtests():
    """Started load tests; any still running at the end is killed with its Locust (in a session of its own)."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.communicate()


def _start_interruptible(tmp_path, stuck: bool, loadtests) -> subprocess.Popen:
    locustfile = tmp_path / "users.py"
    locustfile.write_text(INTERRUPTIBLE_USERS)
    env = {**run.os.environ, "MARKS": str(tmp_path), "PYTHONPATH": str(run.LOADTEST_DIR)}
    if stuck:
        env["STUCK"] = "1"
    command = [sys.executable, "-m", "prepos_loadtest.run", "--locustfile", str(locustfile), "--host", "127.0.0.1:9",
               "--users", "2", "--spawn-rate", "10", "--run-time", "5m", "--stop-timeout", "60",
               "--out", str(tmp_path / "out")]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loadtests.append(process)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2:  # both users: each one's END is counted below
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "the users never started"
        time.sleep(0.1)
    time.sleep(1.0 if not stuck else 0.3)
    return process


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_sent_to_the_load_test_alone_stops_the_run_and_does_not_call_it_passed(tmp_path, signum, loadtests):
    # Sent to the process, not its group (as `kill` or a job runner does): Locust still gets it, through us.
    process = _start_interruptible(tmp_path, stuck=False, loadtests=loadtests)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == run.EXIT_INTERRUPTED, output
    assert "interrupted before the end of --run-time: FAIL" in output
    assert (tmp_path / "stopped").exists(), "the users were not stopped (their sessions would stay open)"
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["passed"] is False
    assert summary["num_requests"] > 0 and summary["num_failed"] == 0
    # The users' ENDs, sent while they stop, are measured: in the CSV (and so the summary) and the HTML report.
    rows = list(csv.DictReader((tmp_path / "out" / "loadtest_stats.csv").open()))
    assert [int(row["Request Count"]) for row in rows if row["Name"] == "close"] == [2], output
    assert '"close"' in (tmp_path / "out" / "report.html").read_text()


def test_an_interrupt_while_the_users_stop_at_the_end_of_the_run_time_stops_nothing(tmp_path):
    """At the end of its run time Locust stops its users (their ENDs) and writes its statistics; an interrupt then
    cut that short: the ENDs went unmeasured (in the CSVs, the report) and the complete run was called interrupted."""
    locustfile = tmp_path / "users.py"
    locustfile.write_text(INTERRUPTIBLE_USERS)
    env = {**run.os.environ, "MARKS": str(tmp_path), "PYTHONPATH": str(run.LOADTEST_DIR), "SLOW_STOP": "2"}
    command = [sys.executable, "-m", "prepos_loadtest.run", "--locustfile", str(locustfile), "--host", "127.0.0.1:9",
               "--users", "2", "--spawn-rate", "10", "--run-time", "3s", "--stop-timeout", "30",
               "--out", str(tmp_path / "out")]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "stopped").exists():  # the run time is over: the users are stopping
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the users never stopped"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == run.EXIT_OK, output
    assert "the interrupt came after the end of --run-time" in output and "FAIL" not in output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["passed"] is True
    rows = list(csv.DictReader((tmp_path / "out" / "loadtest_stats.csv").open()))
    assert [int(row["Request Count"]) for row in rows if row["Name"] == "close"] == [2], output
    assert '"close"' in (tmp_path / "out" / "report.html").read_text()


def test_the_run_end_record_is_the_first_quittings_and_a_run_stopped_before_its_users_ran_was_stopped_early(
        tmp_path):
    """Locust fires `quitting` twice when a SIGTERM follows an interrupt (the load test's stop of a slow Locust): the
    second, its users stopped by then, overwrote the record with "not interrupted" and the run was called complete.
    One stopped before any user started (its runner still in INIT) was called complete too."""
    script = textwrap.dedent(f"""
        import json, types
        from locust.runners import STATE_INIT, STATE_RUNNING, STATE_STOPPED
        from prepos_loadtest import grpc_user

        def environment(state, prefix):
            runner = types.SimpleNamespace(state=state, stop=lambda: None)
            return types.SimpleNamespace(runner=runner, parsed_options=types.SimpleNamespace(
                csv_prefix=prefix, html_file=None))

        for name, states in (("sigterm", [STATE_RUNNING, STATE_STOPPED]), ("init", [STATE_INIT]),
                             ("complete", [STATE_STOPPED])):
            prefix = {str(tmp_path)!r} + "/" + name
            for state in states:
                grpc_user._before_exit(environment(state, prefix))
            print(name, json.loads(open(prefix + "_run_end.json").read())["interrupted"])
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=run.LOADTEST_DIR, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["sigterm True", "init True", "complete False"], done.stdout


def test_a_stopping_test_holds_interrupts_and_the_web_ui_gets_them_back_once_its_users_stopped():
    """In the web UI every Stop fires test_stopping: SIGINT stayed ignored after the first, and Ctrl-C no longer
    quit Locust. A headless run keeps ignoring it to its end."""
    script = textwrap.dedent("""
        import signal, types
        from prepos_loadtest import grpc_user

        for headless in (False, True):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            env = types.SimpleNamespace(parsed_options=types.SimpleNamespace(headless=headless))
            grpc_user._hold_interrupts(environment=env)
            held = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            grpc_user._release_interrupts(environment=env)
            print(headless, held, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=run.LOADTEST_DIR, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["False True False", "True True True"], done.stdout


def test_an_interrupt_while_the_users_stop_for_the_first_ends_locust_at_once(tmp_path):
    """A second Ctrl-C before Locust's stop held interrupts raised inside the quitting hook: Locust's shutdown was
    cut short and the process hung on its greenlets."""
    script = textwrap.dedent(f"""
        import types
        from locust.runners import STATE_RUNNING
        from prepos_loadtest import grpc_user

        def stop():
            raise KeyboardInterrupt
        runner = types.SimpleNamespace(state=STATE_RUNNING, stop=stop)
        grpc_user._before_exit(types.SimpleNamespace(runner=runner, parsed_options=types.SimpleNamespace(
            csv_prefix={str(tmp_path / "run")!r}, html_file=None)))
        print("not reached")
        """)
    done = subprocess.run([sys.executable, "-c", script], cwd=run.LOADTEST_DIR, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 130 and "not reached" not in done.stdout, done.stdout + done.stderr
    assert "interrupted again: stopping at once" in done.stderr


def test_a_second_interrupt_stops_a_run_whose_users_do_not_finish(tmp_path, loadtests):
    process = _start_interruptible(tmp_path, stuck=True, loadtests=loadtests)
    process.send_signal(signal.SIGINT)
    time.sleep(2.0)
    assert process.poll() is None, "the first interrupt should wait for the users (--stop-timeout 60)"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=30)
    assert time.monotonic() - started < 15, output
    assert process.returncode == run.EXIT_INTERRUPTED, output
    assert "interrupt again to stop at once" in output


def test_with_no_server_the_users_ends_do_not_wait_for_one(tmp_path):
    """With --wait-for-ready and no server, each user's request waits (within --request-timeout-s) until Locust stops
    the user; its END is then tried once, as Client.close does, rather than waiting its whole time limit too."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "prepos_loadtest.run", "--host", "127.0.0.1:9", "--workload", "monitor",
               "--users", "2", "--spawn-rate", "2", "--run-time", "3s", "--stop-timeout", "2", "--wait-for-ready",
               "--request-timeout-s", "60", "--out", str(out)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=run.LOADTEST_DIR, capture_output=True, text=True, timeout=180)
    assert time.monotonic() - started < 45, done.stdout  # not a request timeout per END
    assert done.returncode == 1, done.stdout + done.stderr
    rows = {(row["Type"], row["Name"]): row for row in csv.DictReader((out / "loadtest_stats.csv").open())}
    assert int(rows["TOTAL", "close"]["Failure Count"]) == 2, rows  # each user's END, tried once
