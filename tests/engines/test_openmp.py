"""The thread that loaded the model gives its OpenMP workers back once the engine loop runs the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_release_frees_the_callers_workers_and_leaves_other_threads_their_count():
    # In a child process: it changes the calling thread's OpenMP state for good.
    script = textwrap.dedent("""
        import os, threading, torch
        from prepos.engines.openmp import release_calling_thread

        def threads():
            return len(os.listdir("/proc/self/task"))

        torch.set_num_threads(2)
        a = torch.randn(600, 600)
        for _ in range(3):
            a @ a  # parallel regions: this thread's OpenMP pool holds a worker now
        torch.ones(1 << 20).sum()
        before = threads()
        assert release_calling_thread()
        after = threads()
        counts = {}
        other = threading.Thread(target=lambda: counts.setdefault("other", torch.get_num_threads()))
        other.start()
        other.join()
        print(before, after, torch.get_num_threads(), counts["other"])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, mine, other = map(int, out.stdout.split())
    assert after < before  # the pool's worker thread is gone
    assert mine == 1 and other == 2
