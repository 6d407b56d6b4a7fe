"""Client: the entry point that opens sessions and checks the server's health."""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from .channel import Tls, check_headers, check_url, tls_of, triton_client
from .errors import PreposError, PreposTimeout, PreposUnavailable, from_triton
from .deadlines import check_timeout
from .lifetime import left_as_superseded
from .session import Session
from .session_ids import new_session_id

logger = logging.getLogger(__name__)

DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "prepos"
ACCESS_TOKEN_HEADER = "prepos-access-token"  # the header a server started with an access token checks (HTTP)
# Over gRPC, Triton expects a restricted protocol's header under its "triton-grpc-protocol-" prefix.
GRPC_ACCESS_TOKEN_HEADER = f"triton-grpc-protocol-{ACCESS_TOKEN_HEADER}"


class Client:
    """Entry point: opens sessions on a prepos server.

    Args:
        url: host:port of Triton's gRPC endpoint.
        model: the Triton model name.
        timeout_s: default time limit of every call of the sessions it opens.
        headers: extra gRPC headers sent on every stream and health call.
        token: the server's access token, sent as gRPC header
            `triton-grpc-protocol-prepos-access-token` (servers started without
            one ignore it).
        wait_for_ready: a call of its sessions that finds the server stopping,
            restarting or not reachable waits, within its time limit, until
            the server is ready again and is sent again then, instead of
            raising at once (see `Session`).
        tls: gRPC over TLS (the Helm chart's router with `router.tls.enabled`):
            True checks the server's certificate against the system's roots; a
            `Tls` names the roots (and a client certificate). False: plain text.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        model: str = DEFAULT_MODEL,
        *,
        timeout_s: float = 60.0,
        headers: Mapping[str, str] | None = None,
        token: str | None = None,
        wait_for_ready: bool = False,
        tls: bool | Tls = False,
    ):
        self.url = check_url(url)
        self.wait_for_ready = bool(wait_for_ready)
        self.tls = tls_of(tls)
        self.model = model
        self.timeout_s = check_timeout(timeout_s)
        self.headers = check_headers(headers)
        if token:
            self.headers[GRPC_ACCESS_TOKEN_HEADER] = token
        self._sessions: weakref.WeakSet[Session] = weakref.WeakSet()
        self._health: grpcclient.InferenceServerClient | None = None

    def session(self, session_id: str | int | None = None, *, resume: bool = False) -> Session:
        """Open a `Session` (on the server with its first request).

        `session_id` None picks a fresh random id. `resume=True` continues a
        session opened earlier (by another process, or before a restart): its
        first request carries START with the `resume` input, so the server goes
        on with the session it holds or reopens it from its journal.
        """
        session = Session(
            self.url,
            self.model,
            new_session_id() if session_id is None else session_id,
            timeout_s=self.timeout_s,
            headers=self.headers,
            resume=resume,
            wait_for_ready=self.wait_for_ready,
            tls=self.tls,
        )
        self._sessions.add(session)
        return session

    def is_ready(self, *, timeout_s: float | None = None) -> bool:
        """True when the server is live and the model is ready."""
        try:
            self.ensure_ready(timeout_s=timeout_s)
        except PreposError:
            return False
        return True

    def ensure_ready(self, *, timeout_s: float | None = None) -> None:
        """Return if the server is live and the model ready.

        Raises:
            PreposUnavailable: the server cannot be reached.
            PreposError: it answers, but the model is not ready.
        """
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        if self._health is None:
            self._health = triton_client(self.url, self.tls)
        # No limit is no deadline: gRPC takes an infinite one (or one past about 7.5e9 s) as expired already
        client_timeout = timeout_s if math.isfinite(timeout_s) else None
        try:
            if not self._health.is_server_live(headers=self.headers, client_timeout=client_timeout):
                raise PreposUnavailable(f"the server at {self.url} is not live")
            if not self._health.is_model_ready(self.model, headers=self.headers, client_timeout=client_timeout):
                raise PreposError(f"model {self.model!r} is not ready at {self.url}")
        except InferenceServerException as error:
            failure = from_triton(error)
            if isinstance(failure, PreposTimeout):
                raise PreposUnavailable(f"no answer from {self.url} within {timeout_s:g} s", status=failure.status)
            raise failure from None

    def close(self) -> None:
        """Close every session of this client that is still open, then the health connection. Each END is tried
        once, without waiting for a server that is down (`wait_for_ready`)."""
        try:
            for session in list(self._sessions):
                session.wait_for_ready = False
                if left_as_superseded(session):
                    continue
                try:
                    session.close()
                except PreposError:
                    logger.warning("closing session %r failed", session.session_id, exc_info=True)
        finally:
            if self._health is not None:
                self._health.close()
                self._health = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()
