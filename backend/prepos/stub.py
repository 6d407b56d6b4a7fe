"""The Triton backend stub process's tie to its server.

python_backend runs a model in a stub process that tritonserver starts. Some of the
stub's calls to the server (a custom-metric update, ``is_cancelled``) wait for the
server's reply holding the lock the stub's own exit on a dead server needs (a metric
update holds the GIL too): a call made after the server died leaves the stub, with
the model and its KV, hung until it is killed. The adapters make no such call once
the server is gone; :func:`server_alive` says so without one.
"""

from __future__ import annotations

import os

SERVER_PID = os.getppid()  # in a backend stub: tritonserver, which started it (this module loads with the model)


def server_alive() -> bool:
    """Whether the process that started this one still runs (a stub is re-parented when its server dies)."""
    return os.getppid() == SERVER_PID
