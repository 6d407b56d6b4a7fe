"""The readiness a router should act on: Triton's, and not leaving.

Triton's own ``/v2/health/ready`` stays 200 while a replica drains before its stop (a draining model still reports
ready), so a router polling it keeps placing sessions on a replica that refuses to reopen them, until Triton has
stopped. :class:`ReplicaHealth` answers ``GET /ready`` on a port of its own for the router's health checks
(``prepos.supervise`` serves it when ``PREPOS_HEALTH_PORT`` is set; the Helm chart's Envoy polls it):

- 200 ``ready``: Triton answers 200 on its ``/v2/health/ready``, and the replica is not leaving;
- 503 ``leaving: ...``: the leaving file exists (the chart's preStop hook writes it before its sleep, so that the
  router takes the replica out of its ring before the drain begins), or the supervisor was told to stop;
- 503 ``not ready: ...``: Triton answers otherwise, or not within :data:`TRITON_TIMEOUT_S`.

Streams already open on the replica are left alone by the router; their sessions are ended by the drain and move
on their next request, which the router now sends to another replica. Standard library only, as the supervisor.
"""

from __future__ import annotations

import http.client
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

log = logging.getLogger("prepos.replica_health")

HEALTH_PORT_ENV = "PREPOS_HEALTH_PORT"
LEAVING_FILE_ENV = "PREPOS_LEAVING_FILE"
READY_PATH = "/ready"
TRITON_READY_PATH = "/v2/health/ready"
TRITON_TIMEOUT_S = 1.0
"""How long Triton has to answer its readiness check, per check."""


class ReplicaHealth:
    """``GET /ready`` on ``port`` (all interfaces; 0: a free one, see ``port``), for Triton on loopback
    ``triton_http_port``. ``leaving_file``: its existence means the replica is leaving. Serves from a daemon thread
    once started; ``close`` stops it."""

    def __init__(self, port: int, triton_http_port: int, leaving_file: Path | None = None, host: str = "0.0.0.0"):
        self.triton_http_port = triton_http_port
        self.leaving_file = leaving_file
        self._stopping = threading.Event()
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != READY_PATH:
                    self._answer(404, f"not found: {self.path[:100]} (GET {READY_PATH})")
                    return
                ready, why = health.check()
                self._answer(200 if ready else 503, why)

            def _answer(self, status: int, text: str) -> None:
                body = (text + "\n").encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's name
                pass  # a router polls every few seconds: not worth a log line each

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def leave(self) -> None:
        """From now on, answer that the replica is leaving (its stop began)."""
        self._stopping.set()

    def check(self) -> tuple[bool, str]:
        """Whether the replica is ready for new sessions, and the text that says so."""
        if self._stopping.is_set():
            return False, "leaving: stopping"
        if self.leaving_file is not None and self.leaving_file.exists():
            return False, f"leaving: {self.leaving_file} exists"
        connection = http.client.HTTPConnection("127.0.0.1", self.triton_http_port, timeout=TRITON_TIMEOUT_S)
        try:
            connection.request("GET", TRITON_READY_PATH)
            status = connection.getresponse().status
        except (OSError, http.client.HTTPException) as err:
            return False, f"not ready: Triton's {TRITON_READY_PATH} did not answer ({err!r})"
        finally:
            connection.close()
        if status != 200:
            return False, f"not ready: Triton's {TRITON_READY_PATH} answered {status}"
        return True, "ready"

    def start(self) -> ReplicaHealth:
        self._thread = threading.Thread(target=self._server.serve_forever, name="prepos-replica-health",
                                        daemon=True)
        self._thread.start()
        log.info("replica health on port %d: GET %s", self.port, READY_PATH)
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()


def forget_leaving(leaving_file: Path | None) -> None:
    """Remove a leaving file an earlier run left (a container restarted in a pod whose /tmp outlived it): this run
    is not leaving."""
    if leaving_file is None:
        return
    try:
        leaving_file.unlink()
        log.info("removed %s, left by an earlier run", leaving_file)
    except FileNotFoundError:
        pass
