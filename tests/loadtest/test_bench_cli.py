"""The benchmark drivers refuse bad arguments with a message naming the flag (exit 2) before they start a
server or load a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import batch_bench
import bench
import chunking_bench
import engine_microbench
import http_bench
import http_drop_stress
import pool_bench
import residency_bench
import restart_trials
import scan_bench
import share_bench
import server_death_trials
import session_trials
import stop_trials
import timeout_trials
from prepos_loadtest.soak import main as soak_main

ENGINE = "engines/smollm2-135m-instruct"


@pytest.mark.parametrize(("module", "argv", "flag"), [
    (bench, ["--sessions", "0"], "--sessions"),
    (bench, ["--floor-samples", "-1"], "--floor-samples"),
    (bench, ["--think-time", "-1"], "--think-time"),
    (bench, ["--think-time", "nan"], "--think-time"),
    (bench, ["--grpc-port", "70000"], "--grpc-port"),
    (bench, ["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
    (residency_bench, ["--sessions", "0"], "--sessions"),
    (residency_bench, ["--budget-mib", "0"], "--budget-mib"),
    (residency_bench, ["--pause", "nan"], "--pause"),
    (residency_bench, ["--passes", "1"], "--passes"),
    (residency_bench, ["--mode", "fifo"], "--mode"),
    (residency_bench, ["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
    (share_bench, ["--sessions", "201"], "--sessions"),
    (share_bench, ["--users", "0"], "--users"),
    (share_bench, ["--think", "-1"], "--think"),
    (share_bench, ["--think", "inf"], "--think"),
    (share_bench, ["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
    (pool_bench, ["--sessions", "0"], "--sessions"),
    (pool_bench, ["--page-tokens", "48"], "--page-tokens"),
    (pool_bench, ["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
    (batch_bench, ["--users", "a"], "--users: expected comma-separated whole numbers of at least 1 (1,4,8), got 'a'"),
    (batch_bench, ["--users", "1,"], "--users: expected comma-separated whole numbers"),
    (batch_bench, ["--users", "4,0"], "--users: expected comma-separated whole numbers"),
    (batch_bench, ["--waves", "0"], "--waves"),
    (batch_bench, ["--grpc-port", "99999"], "--grpc-port: the server takes it and the next two ports; expected 1-65533"),
    (batch_bench, ["--engine-dir", "/nonexistent-engine"], "--engine-dir"),
])
def test_benchmark_drivers_name_the_bad_flag(module, argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:
        module.main([*argv, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("main", [residency_bench.main, share_bench.main, pool_bench.main, soak_main])
def test_an_out_that_is_a_file_is_refused_and_left_alone(main, capsys, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    with pytest.raises(SystemExit) as exited:
        main(["--out", str(taken)])
    assert exited.value.code == 2
    assert f"--out: {taken} exists and is not a folder" in capsys.readouterr().err
    assert taken.read_text() == "not a folder"


@pytest.mark.parametrize("main", [residency_bench.main, share_bench.main, pool_bench.main, soak_main, bench.main,
                                  batch_bench.main, http_bench.main, http_drop_stress.main, restart_trials.main,
                                  server_death_trials.main, session_trials.main, stop_trials.main,
                                  timeout_trials.main])
def test_an_out_that_cannot_be_made_is_refused_naming_it_before_anything_starts(main, capsys, tmp_path):
    """A soak given --out /proc/x started its server, then failed with a traceback naming --run-dir."""
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for out, problem in [(taken / "out", f"cannot make {taken / 'out'}: {taken} is not a folder"),
                         (Path("/proc/prepos-out"), "cannot make /proc/prepos-out in /proc")]:
        with pytest.raises(SystemExit) as exited:
            main(["--out", str(out)])
        assert exited.value.code == 2
        assert f"--out: {problem}" in capsys.readouterr().err


@pytest.mark.parametrize("main", [bench.main, batch_bench.main, residency_bench.main, share_bench.main])
def test_a_grpc_port_whose_next_ports_are_held_is_refused_naming_it_before_the_server_starts(main, capsys, tmp_path):
    """The launcher's message named --http-port, --grpc-port and --metrics-port, which a benchmark does not have,
    after a traceback."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        http_port = held.getsockname()[1]  # the benchmark's HTTP port: its gRPC port + 1
        with pytest.raises(SystemExit) as exited:
            main(["--grpc-port", str(http_port - 1), "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    assert (f"--grpc-port {http_port - 1}: the server takes it and the next two ports, and {http_port} (HTTP) is in "
            "use by another process; give another --grpc-port") in capsys.readouterr().err


def test_scan_bench_agreement_counts_the_draws_that_differ_from_the_reference():
    from prepos.scan import ScanResult, scan_numpy

    def always_zero(logits, **kwargs):
        return ScanResult(token_id=0, p_max=1.0, margin=1.0, entropy=0.0, num_allowed=len(logits))

    result = scan_bench.agreement(2, 1, impls={"the reference": scan_numpy, "always token 0": always_zero})
    assert result["cases"] == 2 * len(scan_bench.AGREEMENT_VOCABS)
    assert result["rows"]["the reference"] == {t: 0 for t in scan_bench.AGREEMENT_TEMPERATURES}
    assert result["rows"]["always token 0"] == {t: result["cases"] for t in scan_bench.AGREEMENT_TEMPERATURES}
    table = scan_bench.agreement_table(result)
    assert "| implementation | temperature 0.85 | temperature 5 | temperature 1000 |" in table
    assert "| always token 0 | 4 | 4 | 4 |" in table


def test_scan_bench_agreement_writes_its_json_into_a_folder_it_makes(tmp_path, monkeypatch, capsys):
    """The check passes a --json whose folder is yet to be made; the agreement's results were written without
    making it (FileNotFoundError after the whole run)."""
    result = {"machine": "test", "cases": 2, "rows": {"x": {t: 0 for t in scan_bench.AGREEMENT_TEMPERATURES}}}
    monkeypatch.setattr(scan_bench, "agreement", lambda *a: result)
    target = tmp_path / "new" / "agreement.json"
    assert scan_bench.main(["--agreement", "1", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["cases"] == 2 and "| x | 0 | 0 | 0 |" in capsys.readouterr().out


def test_scan_bench_takes_a_json_file_it_can_write_over(tmp_path, monkeypatch):
    """An existing file is written over: its folder's own permissions are not asked."""
    class Started(Exception):
        pass

    def run(*args):
        raise Started

    monkeypatch.setattr(scan_bench, "run", run)
    (tmp_path / "scan.json").write_text("{}")
    with pytest.raises(Started):
        scan_bench.main(["--json", str(tmp_path / "scan.json")])


@pytest.mark.parametrize(("argv", "problem"), [
    (["--temperature", "nan"], "--repeats and --threads must be >= 1, --temperature a number >= 0"),
    (["--temperature", "inf"], "--temperature a number >= 0"),
    (["--json", "/proc/prepos/scan.json"], "--json: cannot make /proc/prepos in /proc"),
    (["--json", "/"], "--json: / is a folder"),
])
def test_scan_bench_refuses_a_bad_temperature_or_json_before_the_run(argv, problem, capsys, monkeypatch):
    """--temperature nan ran; a --json it could not write failed with a traceback after the whole run."""
    monkeypatch.setattr(scan_bench, "run", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exited:
        scan_bench.main(argv)
    assert exited.value.code == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "flag"), [
    (engine_microbench, ["--model-dir", "/nonexistent-model"], "--model-dir"),
    (engine_microbench, ["--model-dir", ENGINE, "--steps", "0"], "--steps"),
    (engine_microbench, ["--model-dir", ENGINE, "--turn-runs", "0"], "--turn-runs"),
    (chunking_bench, ["--model-dir", "/nonexistent-model"], "--model-dir"),
    (chunking_bench, ["--model-dir", ENGINE, "--reps", "0"], "--reps"),
])
def test_microbenchmarks_name_the_bad_flag(module, argv, flag, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--sessions", "-1"], ["--decode-s", "0"], ["--wait-s", "nan"]])
def test_server_death_trials_refuse_bad_counts_before_starting_a_server(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        server_death_trials.main(argv)
    assert exited.value.code == 2
    assert "--trials and --sessions must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--sessions", "0"], ["--exit-timeout-s", "0"]])
def test_stop_trials_refuse_bad_counts_before_starting_a_server(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        stop_trials.main(argv)
    assert exited.value.code == 2
    assert "--trials, --sessions and --exit-timeout-s must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--trials", "0"], ["--sessions", "0"], ["--outage-s", "-1"], ["--outage-s", "nan"],
                                  ["--outage-s", "inf"]])
def test_restart_trials_refuse_bad_counts_before_starting_a_server(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        restart_trials.main(argv)
    assert exited.value.code == 2
    assert "--trials and --sessions must be at least 1, --outage-s a number of seconds >= 0" in \
        capsys.readouterr().err


@pytest.mark.parametrize("trials", [timeout_trials, session_trials])
@pytest.mark.parametrize("argv", [["--trials", "0"], ["--sessions", "0"], ["--actions", "-2"]])
def test_session_and_timeout_trials_refuse_bad_counts_before_starting_a_server(trials, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        trials.main(argv)
    assert exited.value.code == 2
    assert "--trials, --sessions and --actions must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_timeout_trials_refuse_a_bad_margin_before_starting_a_server(value, capsys):
    with pytest.raises(SystemExit) as exited:
        timeout_trials.main([f"--margin-ms={value}"])
    assert exited.value.code == 2
    assert "--margin-ms must be a finite number of milliseconds" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_session_trials_refuse_a_bad_kv_budget_before_starting_a_server(value, capsys):
    with pytest.raises(SystemExit) as exited:
        session_trials.main(["--kv-budget-mb", value])
    assert exited.value.code == 2
    assert "--kv-budget-mb" in capsys.readouterr().err
