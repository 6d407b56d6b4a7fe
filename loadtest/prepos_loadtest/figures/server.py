"""The one server every figure measures: prepos and its baselines side by side, started on free loopback ports.

Its model repository holds, all on the same engine directory:

| model | configuration | serves |
| --- | --- | --- |
| `prepos` | as shipped | `exact`, `gated`, `prepaid` (and `prefix` before pre-positioning finished) |
| `prepos_prefix` | `scheduler.preposition = false` | `prefix`: what a prefix cache pays |
| `prepos_rebuild` | pre-positioning off, a 1-byte KV budget | `rebuild`: a session's KV is evicted by the next session's request |
| `floor` | a no-op decoupled model | the transport floor (gRPC + Triton + Python backend) |
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from prepos.launcher import REPO_ROOT, ServerOptions, TritonServer

from .. import repository
from ..repository import free_loopback_ports, variant_repository

log = logging.getLogger("prepos.figures")

ENGINE_DIR = REPO_ROOT / "engines" / "smollm2-135m-instruct"
MAIN, PREFIX, REBUILD, FLOOR = "prepos", "prepos_prefix", "prepos_rebuild", repository.FLOOR
GAUGE_REFRESH_S = 0.6  # a little over the scheduler's housekeeping interval, which refreshes prepos_sessions
VARIANTS = {
    MAIN: {},
    PREFIX: {"scheduler.preposition": "false"},
    REBUILD: {"scheduler.preposition": "false", "memory.kv_budget_bytes": "1"},
}


@dataclass
class FigureServer:
    """A started server and how to read it; use as a context manager."""

    run_dir: Path
    engine_dir: Path = ENGINE_DIR
    server: TritonServer | None = None

    def __enter__(self) -> "FigureServer":
        if not (self.engine_dir / "prepos_engine.json").is_file():
            raise RuntimeError(f"{self.engine_dir} has no engine: run `make engine` first")
        repo = variant_repository(self.run_dir, "figures_repository", VARIANTS)
        http, grpc, metrics = free_loopback_ports(3)
        options = ServerOptions(model_repositories=(repo,), http_port=http, grpc_port=grpc, metrics_port=metrics,
                                run_dir=self.run_dir, ready_timeout_s=300)
        self.server = TritonServer(options, env={"PREPOS_ENGINE_DIR": str(self.engine_dir.resolve())})
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()

    @property
    def url(self) -> str:
        return self.server.grpc_url

    def metric(self, name: str, **labels: str) -> float:
        """Current value of a server metric, summed over the samples matching `labels` (e.g. model=...)."""
        return self.server.metric(name, **labels)

    def wait_positioned(self, model: str, num_sessions: int = 1, timeout_s: float = 60.0) -> bool:
        """Wait until at least `num_sessions` open sessions of `model` are positioned, then for quiet background.

        The gauge is refreshed by the server's housekeeping (every 0.5 s), so it is read only after one
        refresh has passed: before that it may still count a session that was closed just now. Returns
        False on timeout; the request that follows is then served by whatever path the server picks, and
        the samples say which.
        """
        time.sleep(GAUGE_REFRESH_S)
        deadline = time.monotonic() + timeout_s
        while self.metric("prepos_sessions", model=model, state="positioned") < num_sessions:
            if time.monotonic() > deadline:
                log.warning("%s: fewer than %d sessions positioned after %.0f s", model, num_sessions, timeout_s)
                return False
            time.sleep(0.05)
        return self.wait_background_idle(model, timeout_s=max(1.0, deadline - time.monotonic()))

    def wait_background_idle(self, model: str, quiet_s: float = 0.4, timeout_s: float = 120.0) -> bool:
        """Wait until `model`'s background prefill counter has not moved for `quiet_s` (pre-positioning done).

        Returns False when it still moved after `timeout_s`.
        """
        deadline, last, still_since = time.monotonic() + timeout_s, -1.0, time.monotonic()
        while time.monotonic() < deadline:
            now = self.metric("prepos_prefill_tokens_total", model=model, where="background")
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= quiet_s:
                return True
            time.sleep(0.05)
        log.warning("%s: background work still running after %.0f s", model, timeout_s)
        return False
