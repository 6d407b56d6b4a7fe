"""A backend stub knows its server is gone once it is re-parented, without a call to the server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time


def test_server_alive_turns_false_when_the_starting_process_exits(tmp_path):
    report = tmp_path / "report"
    stub = textwrap.dedent(f"""
        import time
        from prepos.stub import server_alive
        with open({str(report)!r}, "a") as out:
            out.write(f"{{server_alive()}}\\n")
        for _ in range(200):  # until the process that started this one has gone
            if not server_alive():
                break
            time.sleep(0.05)
        with open({str(report)!r}, "a") as out:
            out.write(f"{{server_alive()}}\\n")
    """)
    server = textwrap.dedent(f"""
        import pathlib, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {stub!r}])
        report = pathlib.Path({str(report)!r})
        for _ in range(400):  # exit once the stub has seen this process alive
            if report.exists() and report.read_text():
                break
            time.sleep(0.025)
    """)
    subprocess.run([sys.executable, "-c", server], check=True, timeout=60)
    deadline = time.monotonic() + 30
    while len(report.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the stub never saw its server go"
        time.sleep(0.05)
    assert report.read_text().split() == ["True", "False"]
