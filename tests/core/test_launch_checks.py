"""The launcher's checks before tritonserver starts: the journal folder it is given, and a server that does not
outlive a launcher killed outright."""

from __future__ import annotations

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
    of its own, with no one to stop it."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {BACKEND_DIR!r})
        from prepos.launch_checks import stop_with_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                                 preexec_fn=stop_with_parent())
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
