"""`python -m prepos_loadtest.trace`: exporting built-in workloads and checking trace files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prepos_loadtest.trace import main
from prepos_loadtest.workloads import ThinkTime, build_workload, read_trace

LOADTEST_DIR = Path(__file__).resolve().parents[2] / "loadtest"


@pytest.mark.parametrize("workload", ["bfcl", "monitor", "chat"])
def test_export_writes_the_built_in_workload(tmp_path, capsys, workload):
    out = tmp_path / "sub" / f"{workload}.jsonl"
    assert main(["export", "--workload", workload, "--sessions", "3", "--seed", "2", "--out", str(out)]) == 0
    assert read_trace(out) == build_workload(workload, 3, seed=2)
    assert "wrote 3 sessions" in capsys.readouterr().out


def test_export_with_a_think_time_distribution(tmp_path):
    out = tmp_path / "chat.jsonl"
    main(["export", "--workload", "chat", "--sessions", "4", "--out", str(out),
          "--think-median", "0.5", "--think-sigma", "0.3"])
    assert read_trace(out) == build_workload("chat", 4, think_time=ThinkTime(0.5, 0.3))


def test_export_runs_as_a_module(tmp_path):
    out = tmp_path / "monitor.jsonl"
    done = subprocess.run([sys.executable, "-m", "prepos_loadtest.trace", "export", "--workload", "monitor",
                           "--sessions", "2", "--out", str(out)], cwd=LOADTEST_DIR, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [t.name for t in read_trace(out)] == ["monitor_0", "monitor_1"]


@pytest.mark.parametrize("argv", [
    ["export", "--workload", "nope", "--sessions", "1", "--out", "x.jsonl"],
    ["export", "--workload", "chat", "--sessions", "0", "--out", "x.jsonl"],
    ["export", "--workload", "chat", "--sessions", "1", "--out", "x.jsonl", "--think-median", "-1"],
    ["export", "--workload", "chat", "--out", "x.jsonl"],
])
def test_export_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert not (tmp_path / "x.jsonl").exists()


def test_summary_counts_a_trace(tmp_path, capsys):
    out = tmp_path / "bfcl.jsonl"
    main(["export", "--workload", "bfcl", "--sessions", "2", "--out", str(out)])
    capsys.readouterr()
    traces = read_trace(out)
    assert main(["summary", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "sessions        2" in printed
    assert f"steps           {sum(len(t.steps) for t in traces)}" in printed


def test_summary_reports_an_invalid_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": "s", "delta": 3, "max_tokens": 1}\n')
    assert main(["summary", str(bad)]) == 1
    assert "bad.jsonl:1: delta: expected a string" in capsys.readouterr().err


def test_export_to_a_path_it_cannot_write_is_a_usage_error(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (tmp_path, blocker / "t.jsonl"):  # a folder; under a file
        with pytest.raises(SystemExit) as exit_info:
            main(["export", "--workload", "chat", "--sessions", "2", "--out", str(out)])
        assert exit_info.value.code == 2
        assert f"--out {out}: cannot write the trace" in capsys.readouterr().err
