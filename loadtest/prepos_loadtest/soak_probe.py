"""Reading a running prepos server from the outside: its metrics endpoint and its processes' memory.

Used by the soak (metric values are read with ``prepos.metrics.metric_sum``). Nothing here sends inference traffic.
"""

from __future__ import annotations

import http.client
import logging
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("prepos.loadtest")


def scrape(metrics_url: str, timeout_s: float = 5.0) -> str:
    """The text of Triton's Prometheus endpoint.

    Raises:
        OSError: it cannot be read: unreachable, not HTTP (a gRPC port, say), a malformed address, not text.
    """
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            return response.read().decode()
    except (http.client.HTTPException, ValueError) as error:  # InvalidURL, BadStatusLine, UnicodeDecodeError
        raise OSError(f"{type(error).__name__}: {error}") from None


@dataclass(frozen=True)
class TreeMemory:
    """Resident memory of a process and all its descendants (the Python backend stubs of Triton)."""

    rss_bytes: int
    num_processes: int


def tree_memory(pid: int) -> TreeMemory | None:
    """Sum of RSS over `pid` and its descendants; None when `pid` is gone.

    Children that exit while they are being read are skipped.
    """
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total, counted = 0, 0
    for process in processes:
        try:
            total += process.memory_info().rss
            counted += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return TreeMemory(total, counted) if counted else None


def pid_listening_on(port: int) -> int | None:
    """The pid of the local process listening on TCP `port`, when this user may see it."""
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    for connection in connections:
        if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == port:
            return connection.pid
    return None
