"""The launcher's checks before tritonserver starts: the journal folder it is given, and a server that does not
outlive a launcher killed outright."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from prepos.launch_checks import journal_environment

BACKEND_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "backend")


def test_journal_dir_flag_wins_over_the_environment_and_off_means_none(tmp_path):
    run_dir = tmp_path / "run"
    env = {"PREPOS_JOURNAL_DIR": str(tmp_path / "from-env")}
    assert journal_environment(str(tmp_path / "flag"), run_dir, env) == {"PREPOS_JOURNAL_DIR": str(tmp_path / "flag")}
    assert (tmp_path / "flag").is_dir() and not (tmp_path / "from-env").exists()
    assert journal_environment("off", run_dir, env) == {"PREPOS_JOURNAL_DIR": ""}  # none, whatever the environment
    assert journal_environment("", run_dir, env) == {"PREPOS_JOURNAL_DIR": str(tmp_path / "from-env")}
    assert journal_environment("", run_dir, {"PREPOS_JOURNAL_DIR": ""}) == {}  # set empty: none
    assert journal_environment("", run_dir, {}) == {"PREPOS_JOURNAL_DIR": str(run_dir / "journal")}


def test_a_relative_journal_variable_is_left_to_the_model_whose_folder_it_is_relative_to(tmp_path):
    assert journal_environment("", tmp_path, {"PREPOS_JOURNAL_DIR": "journals"}) == {}
    assert not (tmp_path / "journals").exists()


def test_a_host_name_binds_its_ipv4_address():
    """Given a name, Triton's HTTP endpoint bound 255.255.255.255 and the launcher waited its whole ready timeout."""
    from prepos.launch_checks import bind_address

    assert bind_address("127.0.0.1") == "127.0.0.1" and bind_address("0.0.0.0") == "0.0.0.0"
    assert bind_address("localhost") == "127.0.0.1"
    from prepos.launcher import ServerOptions, server_command
    command = server_command(ServerOptions(host="localhost"), "backends")
    assert "--http-address=127.0.0.1" in command and "--grpc-address=127.0.0.1" in command
    with pytest.raises(ValueError, match=r"^--host: 'no-such-host.invalid' has no IPv4 address"):
        bind_address("no-such-host.invalid")


def test_a_relative_run_dir_is_made_absolute(tmp_path, monkeypatch):
    """tritonserver runs from the repository root: a relative --run-dir gave it a backend folder it could not find."""
    import argparse

    from prepos.launcher import add_arguments, options_from_args

    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args(["--run-dir", "run"])).run_dir == tmp_path / "run"


def test_an_unusable_journal_folder_names_where_it_came_from(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"^--journal-dir: cannot use {blocker} \("):
        journal_environment(str(blocker), tmp_path, {})
    with pytest.raises(ValueError, match=rf"^PREPOS_JOURNAL_DIR: cannot use {blocker}/j \("):
        journal_environment("", tmp_path, {"PREPOS_JOURNAL_DIR": str(blocker / "j")})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_started_so_is_stopped_when_its_launcher_is_killed_outright():
    """A launcher killed with SIGKILL (or by the OOM killer) left tritonserver serving on its ports, in a session
    of its own, with no one to stop it. SIGTERM would not do: undrained, tritonserver serves on to its exit timeout
    (the child here ignores it), then crashed on its way out and hung with its streams open."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {BACKEND_DIR!r})
        from prepos.launch_checks import stop_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); print(flush=True); time.sleep(60)"], start_new_session=True,
                                 preexec_fn=stop_with_parent(), stdout=subprocess.PIPE)
        child.stdout.readline()  # SIGTERM is ignored from now on
        print(child.pid, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(launcher.stdout.readline()))
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        child.wait(10)  # psutil.TimeoutExpired if it outlived its launcher
    finally:
        if child.is_running():
            child.kill()


def test_the_models_warnings_in_the_server_log_are_picked_out_for_the_console(tmp_path):
    from prepos.launcher import ServerOptions, TritonServer

    server = TritonServer(ServerOptions(run_dir=tmp_path / "run"), log_file=tmp_path / "server.log")
    server.log_file.write_text(
        "I1127 12:00:00.000 model_lifecycle.cc:849] successfully loaded 'prepos'\n"
        "2026-11-27 12:00:01,000 INFO prepos.core: session journals in /j (0 sessions to reopen on their next request)\n"
        "2026-11-27 12:00:01,001 WARNING prepos.core: scheduler.session_idle_timeout_s (5 s) is shorter than ...\n")
    assert server.prepos_warnings() == [
        "2026-11-27 12:00:01,001 WARNING prepos.core: scheduler.session_idle_timeout_s (5 s) is shorter than ..."]


def _repository(tmp_path, parameters: str, idle_us: int = 600000000):
    model = tmp_path / "repo" / "prepos"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        f'name: "prepos"\nsequence_batching {{\n  max_sequence_idle_microseconds: {idle_us}\n}}\n'
        f'parameters [\n{parameters}\n]\n')
    (tmp_path / "repo" / "prepos_http").mkdir()  # the bridge's settings are its own: not read here
    (tmp_path / "repo" / "prepos_http" / "config.pbtxt").write_text('parameters [ { key: "bridge.x" value: '
                                                                     '{ string_value: "y" } } ]\n')
    return tmp_path / "repo"


def test_a_prepos_setting_the_model_would_refuse_is_refused_before_triton_starts(tmp_path):
    """The model's load took 7-11 s to refuse them, with exit status 1; now the launcher does, naming the model."""
    from prepos.launch_checks import check_repositories

    good = _repository(tmp_path / "good", '  { key: "gate.threshold" value: { string_value: "0.8" } }\n'
                       '  # { key: "gate.threshold" value: { string_value: "<from prepos calibrate>" } }')
    check_repositories([good], {})  # the line commented out is no setting
    with pytest.raises(ValueError, match=r"^model prepos \(.*config.pbtxt\): gate.threshold: cannot read 'abc' as "
                                         r"float \(set by the environment variable PREPOS_GATE_THRESHOLD\)$"):
        check_repositories([good], {"PREPOS_GATE_THRESHOLD": "abc"})
    bad = _repository(tmp_path / "bad", '  { key: "gate.nosuch" value: { string_value: "1" } }')
    with pytest.raises(ValueError, match=r"^model prepos .*gate.nosuch"):
        check_repositories([bad], {})
    # the idle timeout comes from Triton's own, as in the model: a journal expiry below it is refused
    long_idle = _repository(tmp_path / "idle", '  { key: "journal.expire_s" value: { string_value: "3600" } }',
                            idle_us=7200 * 10**6)
    with pytest.raises(ValueError, match=r"journal.expire_s: must exceed the session idle timeout \(7200 s"):
        check_repositories([long_idle], {})


def test_the_shipped_repository_passes_the_settings_check():
    from prepos.launch_checks import check_repositories
    from prepos.launcher import REPO_ROOT

    check_repositories([REPO_ROOT / "model_repository"], {})


def test_a_config_triton_cannot_parse_is_refused_before_triton_starts(tmp_path, caplog):
    """A comma after the last entry of parameters [ ... ] (as calibration fragments had) passed the launcher's own
    reading, by patterns, and Triton refused the model."""
    from prepos.launch_checks import check_repositories

    trailing_comma = _repository(tmp_path / "comma", '  { key: "gate.threshold" value: { string_value: "0.8" } },')
    with pytest.raises(ValueError, match=r"^model prepos \(.*config.pbtxt\): not a model configuration Triton reads "
                                         r"\(.*Expected \"\{\"\.\)$"):
        check_repositories([trailing_comma], {})
    no_comma = _repository(tmp_path / "no-comma", '  { key: "gate.threshold" value: { string_value: "0.8" } }\n'
                           '  { key: "gate.speculate" value: { string_value: "true" } }')
    with pytest.raises(ValueError, match=r'Expected ","'):
        check_repositories([no_comma], {})
    # a whole parameters field after the list, as calibration fragments are now, is read
    after = _repository(tmp_path / "after", '  { key: "gate.speculate" value: { string_value: "true" } }')
    config = after / "prepos" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "gate.threshold" value: { string_value: "abc" } }\n')
    with pytest.raises(ValueError, match=r"gate.threshold: cannot read 'abc' as float"):
        check_repositories([after], {})
    # a key set twice: Triton 2.51 takes the later entry, and so does the check, with a warning
    config.write_text(config.read_text() + 'parameters { key: "gate.threshold" value { string_value: "0.5" } }\n')
    with caplog.at_level(logging.WARNING, logger="prepos.launcher"):
        check_repositories([after], {})
    assert 'sets "gate.threshold" twice: the later entry counts' in caplog.text
    config.write_text(config.read_text() + 'parameters { key: "gate.threshold" value { string_value: "2" } }\n')
    with pytest.raises(ValueError, match=r"gate.threshold: must lie in \[0, 1\]"):
        check_repositories([after], {})
    # a field of a later Triton than the client library's is passed over, as that Triton would read it
    later = _repository(tmp_path / "later", '  { key: "gate.speculate" value: { string_value: "true" } }')
    config = later / "prepos" / "config.pbtxt"
    config.write_text(config.read_text() + "some_later_field: 3\n")
    check_repositories([later], {})
    # another model's config is Triton's to read, whatever the client library's proto knows of it
    other = later / "user_model"
    other.mkdir()
    (other / "config.pbtxt").write_text('backend: "python"\nfuture_msg [ { a: 1 }, { a: 2 } ]\n')
    check_repositories([later], {})


def test_what_of_the_triton_configuration_the_model_refuses_at_load_is_refused_before_triton_starts(tmp_path):
    """Two instances, or Triton's 1 s idle default, were refused only by the model's load, after Triton started."""
    from prepos.launch_checks import check_repositories

    setting = '  { key: "gate.speculate" value: { string_value: "true" } }'
    two = _repository(tmp_path / "two", setting)
    config = two / "prepos" / "config.pbtxt"
    config.write_text(config.read_text() + "instance_group [ { count: 2 kind: KIND_CPU } ]\n")
    with pytest.raises(ValueError, match=r"^model prepos \(.*config.pbtxt\): instance_group: 2 instances; prepos "
                                         r"runs one .*set count: 1$"):
        check_repositories([two], {})
    config.write_text(config.read_text().replace("count: 2", "count: 1 gpus: [ 0, 1 ]"))
    with pytest.raises(ValueError, match=r"instance_group: 2 instances"):  # count is per GPU listed
        check_repositories([two], {})
    config.write_text(config.read_text().replace("gpus: [ 0, 1 ]", "gpus: [ 0 ]"))
    check_repositories([two], {})
    # the idle timeout left out: Triton's 1 s, refused unless the session idle timeout says 1 s as well
    default_idle = _repository(tmp_path / "idle", setting)
    config = default_idle / "prepos" / "config.pbtxt"
    config.write_text(config.read_text().replace("  max_sequence_idle_microseconds: 600000000\n", ""))
    assert "max_sequence_idle_microseconds" not in config.read_text()
    with pytest.raises(ValueError, match=r"^model prepos .*sequence_batching.max_sequence_idle_microseconds: 1 s, "
                                         r"Triton's default"):
        check_repositories([default_idle], {})
    check_repositories([default_idle], {"PREPOS_SCHEDULER_SESSION_IDLE_TIMEOUT_S": "1"})
    with pytest.raises(ValueError, match=r"scheduler.session_idle_timeout_s: cannot read 'abc'"):  # the bad value
        check_repositories([default_idle], {"PREPOS_SCHEDULER_SESSION_IDLE_TIMEOUT_S": "abc"})
