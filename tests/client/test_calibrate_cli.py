"""`prepos calibrate` end to end on the fake engine: files written, resumable, bad input named."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

import prepos.core
from fakes import FakeEngine, write_engine_dir
from prepos_client import calibrate_cli, cli


@pytest.fixture
def setup(tmp_path, monkeypatch):
    engine_dir = write_engine_dir(tmp_path / "engine")
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: FakeEngine())
    lines = []
    for i in range(12):
        lines.append({"session": f"s{i}", "role": "system", "delta": "Answer yes or no.", "max_tokens": 0})
        lines += [{"session": f"s{i}", "delta": f"Question {i}.{t}?", "max_tokens": 1, "choices": ["yes", "no"]}
                  for t in range(3)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return tmp_path, engine_dir, trace


def test_calibrate_writes_report_and_resumes(setup, capsys):
    tmp_path, engine_dir, trace = setup
    out = tmp_path / "report"
    argv = ["calibrate", "--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.1",
            "--epsilon", "0.3", "--delta", "0.1", "--out", str(out), "--max-points", "20"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "epsilon 0.1:" in printed and "epsilon 0.3:" in printed
    for name in ("report.md", "risk_coverage.csv", "risk_coverage.png", "gate_eps0.1.pbtxt", "gate_eps0.3.pbtxt"):
        assert (out / name).is_file(), name
    records = (out / "records.jsonl").read_text().splitlines()
    assert len(records) == 1 + 20  # header + the points asked for

    # A second run over the whole trace records only the rest.
    assert cli.main(argv[:-2]) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 1 + 36
    fragment = (out / "gate_eps0.1.pbtxt").read_text()
    assert 'key: "gate.speculate"' in fragment and 'key: "gate.epsilon" value: { string_value: "0.1" }' in fragment

    # Report only: a new epsilon from the same records, no engine.
    (out / "report.md").unlink()
    assert calibrate_cli.main(["--report-only", "--epsilon", "0.2", "--out", str(out)]) == 0
    assert (out / "gate_eps0.2.pbtxt").is_file() and "36 decision points" in (out / "report.md").read_text()
    assert calibrate_cli.main(["--report-only", "--epsilon", "0.2", "--out", str(tmp_path / "empty")]) == 1


@pytest.mark.parametrize(("extra", "message"), [
    (["--trace", "missing.jsonl"], "--trace"),
    (["--workload", "bfcl:x"], "--workload"),
    (["--workload", "nope"], "--workload: unknown workload 'nope'; choose one of bfcl, monitor, chat, or bigbench[:TASK]"),
    (["--workload", "bfcl", "--sessions", "2", "--device", "cuda:99"], "engine.device: 'cuda:99'"),
])
def test_bad_input_exits_1_naming_the_argument(setup, capsys, extra, message):
    tmp_path, engine_dir, _ = setup
    code = calibrate_cli.main([*extra, "--engine-dir", str(engine_dir), "--epsilon", "0.1", "--out",
                               str(tmp_path / "o")])
    assert code == calibrate_cli.EXIT_INVALID
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("step", "message"), [
    ({"role": "admin"}, "session 'bad' step 1: role: unknown role 'admin'; the model frames"),
    ({"max_tokens": -5}, "session 'bad' step 1: max_tokens: must be >= 0, got -5"),
    ({"choices": []}, "session 'bad' step 1: choices: empty list"),
    ({"choices": ["x", ""]}, "session 'bad' step 1: choices: an empty entry"),
    ({"choices": ["x", "x"]}, "session 'bad' step 1: choices: duplicate entries"),  # agreed on, always: flattering
    # refused by the trace reader itself, naming the line
    ({"choices": ["x", "y"], "max_tokens": 0}, "trace.jsonl:50: choices: expected null on an update (max_tokens 0)"),
])
def test_a_trace_step_the_server_would_refuse_is_named_before_the_model_loads(setup, capsys, monkeypatch, step,
                                                                              message):
    tmp_path, engine_dir, trace = setup
    bad = {"session": "bad", "delta": "Is it?", "max_tokens": 1, **step}
    trace.write_text(trace.read_text() + json.dumps({"session": "bad", "delta": "Hi.", "max_tokens": 0}) + "\n"
                     + json.dumps(bad) + "\n")
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: pytest.fail("the model was loaded"))
    code = calibrate_cli.main(["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.1", "--out",
                               str(tmp_path / "o")])
    assert code == calibrate_cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "--trace: " in err and message in err, err


@pytest.mark.parametrize(("text", "message"), [(b"", "trace.jsonl: no step: the file is empty or blank"),
                                               (b'{"session": "s", "delta": "\xff", "max_tokens": 1}\n',
                                                "trace.jsonl:1: not UTF-8 text (byte 0xff at byte 27 of the line)")])
def test_an_empty_trace_or_one_that_is_not_utf8_is_named_before_the_model_loads(setup, capsys, monkeypatch, text,
                                                                                 message):
    tmp_path, engine_dir, trace = setup
    trace.write_bytes(text)
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: pytest.fail("the model was loaded"))
    code = calibrate_cli.main(["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.1", "--out",
                               str(tmp_path / "o")])
    assert code == calibrate_cli.EXIT_INVALID
    assert message in capsys.readouterr().err


def test_a_rerun_on_another_trace_under_the_same_session_names_is_refused(setup, capsys):
    """Its points would be skipped as recorded, and the report would cover the first trace's under the second's
    title."""
    tmp_path, engine_dir, trace = setup
    argv = ["calibrate", "--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.1",
            "--out", str(tmp_path / "o"), "--max-points", "6"]
    assert cli.main(argv) == 0
    assert cli.main(argv[:-2]) == 0  # the same trace: the rest is recorded
    capsys.readouterr()
    other = trace.read_text().replace("Question 1.", "Another question 1.")
    trace.write_text(other)
    assert cli.main(argv) == calibrate_cli.EXIT_INVALID
    assert "holds session 's1' turn 1 replayed from other steps" in capsys.readouterr().err


def test_the_help_names_the_workloads_that_are_accepted(capsys):
    with pytest.raises(SystemExit):
        calibrate_cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "built-in workload: bfcl, monitor, chat, or bigbench[:TASK]" in text


@pytest.mark.parametrize("argv", [
    ["--trace", "t.jsonl", "--out", "o"],  # no --epsilon
    ["--trace", "t.jsonl", "--epsilon", "1.5", "--out", "o"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--placeholder", "novalue"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--method", "best"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--score", "p_max", "--score", "confidence"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--variant", "dots"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--no-placeholder", "--variant", "placeholder"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--threads", "-1"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--placeholder", "a=hi", "--no-placeholder"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", "o", "--placeholder", "a=hi", "--placeholder", "a=ho"],
    ["--trace", "t.jsonl", "--epsilon", "0.1", "--out", __file__],
])
def test_usage_errors_exit_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        calibrate_cli.main(argv)
    assert exit_info.value.code == 2
    assert not any(tmp_path.iterdir())  # refused before anything was replayed or written
    flag = next((arg for arg in reversed(argv) if arg.startswith("--")), None)
    if flag in ("--score", "--variant", "--threads", "--no-placeholder", "--placeholder"):
        assert flag in capsys.readouterr().err


def test_a_variant_recorded_by_this_run_is_accepted(setup, capsys):
    tmp_path, engine_dir, trace = setup
    argv = ["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.3", "--out",
            str(tmp_path / "o"), "--max-points", "6", "--placeholder", "dots=...", "--variant", "dots"]
    assert calibrate_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "empty delta" not in printed and ("dots delta" in printed or "gate off" in printed)


def test_a_big_bench_task_that_cannot_be_fetched_is_named(tmp_path, monkeypatch, capsys):
    from prepos_loadtest import bigbench_tasks

    def unreachable(names, cache_dir):
        raise RuntimeError("tasks not found in the bigbench sdist: nope")

    monkeypatch.setattr(bigbench_tasks, "fetch_tasks", unreachable)
    code = calibrate_cli.main(["--workload", "bigbench:nope", "--epsilon", "0.1", "--out", str(tmp_path / "o")])
    assert code == calibrate_cli.EXIT_INVALID
    assert "--workload: BIG-bench task 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _tree(root) -> list:
    return sorted((str(p.relative_to(root)), p.is_dir()) for p in root.rglob("*"))


@pytest.mark.parametrize("out", ["afile/sub", "/proc/prepos-nosuch"])
def test_an_out_that_cannot_be_made_is_a_usage_error_before_the_model_loads(setup, capsys, monkeypatch, out):
    """It gave a traceback (NotADirectoryError, FileNotFoundError) once the model had loaded, seconds in."""
    tmp_path, engine_dir, trace = setup
    if out.startswith("/proc") and not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    assert cli.main(["calibrate", "--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.3",
                     "--out", str(tmp_path / "good"), "--max-points", "6"]) == 0
    (tmp_path / "afile").write_text("")
    before = _tree(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: pytest.fail("the model was loaded"))
    out = str(tmp_path / out) if not out.startswith("/") else out
    for argv in (["--trace", str(trace), "--engine-dir", str(engine_dir), "--out", out],
                 ["--report-only", "--records", str(tmp_path / "good" / "records.jsonl"), "--out", out],
                 ["--trace", str(trace), "--engine-dir", str(engine_dir), "--out", str(tmp_path / "o"),
                  "--records", out + "/records.jsonl"]):
        with pytest.raises(SystemExit) as exit_info:
            calibrate_cli.main([*argv, "--epsilon", "0.3"])
        assert exit_info.value.code == calibrate_cli.EXIT_USAGE
        flag = "--records" if "--records" in argv and "--report-only" not in argv else "--out"
        err = capsys.readouterr().err
        assert f"{flag}: cannot make {out}" in err and "Traceback" not in err, err
        assert _tree(tmp_path) == before  # nothing made, nothing left behind


def test_ctrl_c_during_a_replay_says_what_was_recorded_and_a_rerun_resumes(setup, capsys, monkeypatch):
    """It printed a traceback ending in KeyboardInterrupt."""
    tmp_path, engine_dir, trace = setup

    class InterruptedEngine(FakeEngine):
        num_prefills = 0

        def prefill(self, session_id, token_ids):
            InterruptedEngine.num_prefills += 1
            if InterruptedEngine.num_prefills == 20:
                raise KeyboardInterrupt
            return super().prefill(session_id, token_ids)

    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: InterruptedEngine())
    out = tmp_path / "o"
    argv = ["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.3", "--out", str(out)]
    try:
        code = calibrate_cli.main(argv)
    except KeyboardInterrupt as interrupt:  # it would stop the test session
        pytest.fail(f"the interrupt escaped: {interrupt!r}")
    assert code == calibrate_cli.EXIT_INTERRUPTED == 130
    num_recorded = len((out / "records.jsonl").read_text().splitlines()) - 1
    assert 0 < num_recorded < 36
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"prepos calibrate: interrupted; {num_recorded} decision points recorded by this "
                                    f"run in {out / 'records.jsonl'} (rerun with the same --out to resume)")
    assert "Traceback" not in err
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: FakeEngine())
    assert calibrate_cli.main(argv) == 0
    assert len((out / "records.jsonl").read_text().splitlines()) == 1 + 36


def test_a_workload_with_no_decision_point_is_refused_before_the_model_loads_saying_why(setup, capsys, monkeypatch):
    """Every monitor query has an empty delta: it failed after the model loaded, asking for more sessions."""
    tmp_path, engine_dir, trace = setup
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: pytest.fail("the model was loaded"))
    code = calibrate_cli.main(["--workload", "monitor", "--sessions", "3", "--engine-dir", str(engine_dir),
                               "--epsilon", "0.1", "--out", str(tmp_path / "o")])
    assert code == calibrate_cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "--workload: no decision points: each of the 18 steps that ask for an answer has an empty delta" in err
    assert "more sessions" not in err
    assert not (tmp_path / "o").exists()


def test_a_variant_not_in_the_records_and_records_that_are_a_directory_are_usage_errors(setup, capsys):
    """--report-only dropped an unknown --variant silently; a directory was reported as holding no records."""
    tmp_path, engine_dir, trace = setup
    out = tmp_path / "o"
    assert calibrate_cli.main(["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.3", "--out",
                               str(out), "--max-points", "6"]) == 0
    capsys.readouterr()
    for argv, message in [(["--variant", "empty", "--variant", "nosuch"],
                           f"--variant: 'nosuch' not in {out / 'records.jsonl'}; it records empty, placeholder"),
                          (["--records", str(tmp_path)], f"--records: {tmp_path} is a directory")]:
        with pytest.raises(SystemExit) as exit_info:
            calibrate_cli.main(["--report-only", "--epsilon", "0.3", "--out", str(out), *argv])
        assert exit_info.value.code == calibrate_cli.EXIT_USAGE
        assert message in capsys.readouterr().err


def test_records_that_cannot_go_on_are_named_before_the_model_loads_and_left_as_they_were(setup, capsys, monkeypatch):
    """A --records file that was not a records file was taken for one with a truncated line, replayed into, and
    then refused; records of other placeholders or other steps were told only once the model had loaded."""
    tmp_path, engine_dir, trace = setup
    argv = ["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.1", "--out", str(tmp_path / "o")]
    assert calibrate_cli.main([*argv, "--max-points", "3"]) == 0
    afile = tmp_path / "afile"
    afile.write_text("hi\n")
    monkeypatch.setattr(prepos.core, "create_engine", lambda config, path: pytest.fail("the model was loaded"))
    capsys.readouterr()
    for extra, said in ((["--records", str(afile)], "afile:1: not a calibration record"),
                        (["--placeholder", "dots=..."], "was written with"),):
        assert calibrate_cli.main([*argv, *extra]) == calibrate_cli.EXIT_INVALID
        assert said in capsys.readouterr().err
    assert afile.read_text() == "hi\n"
    with (tmp_path / "o" / "records.jsonl").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run writing to it
        assert calibrate_cli.main(argv) == calibrate_cli.EXIT_INVALID
        assert "another prepos calibrate run is writing to" in capsys.readouterr().err


def test_an_epsilon_given_twice_is_reported_once(setup, capsys):
    tmp_path, engine_dir, trace = setup
    argv = ["--trace", str(trace), "--engine-dir", str(engine_dir), "--epsilon", "0.5", "--epsilon", "5e-1",
            "--epsilon", "0.3", "--out", str(tmp_path / "o")]
    assert calibrate_cli.main(argv) == 0
    assert capsys.readouterr().out.count("epsilon 0.5:") == 1
    assert (tmp_path / "o" / "report.md").read_text().count("## epsilon 0.5,") == 1


def test_a_held_out_part_that_answered_none_prints_no_rate(tmp_path, capsys):
    from prepos.calibration import EMPTY, DecisionRecord, SpeculativeFeatures, records_header

    features = SpeculativeFeatures(1, 0.999, 0.999, 0.1, 0.999, 2, True)
    records = [DecisionRecord(f"s{i}", 0, 5, 2, 1, (1,), {EMPTY: features}) for i in range(300)]
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "records.jsonl").write_text(json.dumps({"header": records_header({})}) + "\n" + "".join(
        record.to_json() + "\n" for record in records))
    argv = ["--report-only", "--epsilon", "0.3", "--held-out", "0", "--out", str(tmp_path / "o")]
    assert calibrate_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "held out: none answered, no false-accept rate to observe" in printed, printed
    assert "[0.0000, 1.0000]" not in printed  # a rate and interval over no answer
