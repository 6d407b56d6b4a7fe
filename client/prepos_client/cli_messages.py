"""What the `prepos` command line says of a failed call: a timeout's outcome once settled, the flag that would
do where an opening was refused, and what to look at where the server could not be reached."""

from __future__ import annotations

import argparse
import contextlib
import re

from .errors import PreposError, PreposTimeout, PreposUnavailable
from .session import Session
from .session_requests import UNKNOWN_OUTCOME


# What the outcome of a call that ran out of the client's time limit adds to its message once settled (the
# server's own deadline error, field `timeout`, says it already).
_TIMEOUT_OUTCOMES = {
    True: " [settled: the server accepted it after all; its turn is in the session's log]",
    False: " [settled: the server stopped it; its turn was not accepted]",
}


def settle_for_message(session: Session, error: BaseException, *, timeout_s: float | None = None) -> None:
    """For a call that ran out of the client's time limit, learn whether the server took its turn after all
    (``error.accepted``), within `timeout_s` (default: the session's limit), so that its message can say so."""
    if isinstance(error, PreposTimeout) and error.accepted is None:
        with contextlib.suppress(PreposError):
            session.settle(timeout_s=timeout_s)


def told(error: PreposError) -> str:
    """A call's error as the command line tells it: for one that ran out of the client's time limit, what the
    server did with it once settled, in place of the library's "not known yet (settle() finds out)"."""
    text = str(error)
    if not isinstance(error, PreposTimeout) or error.field == "timeout":  # the server's own error says it
        return text
    outcome = _TIMEOUT_OUTCOMES.get(error.accepted)
    if outcome is None:
        return text.replace(UNKNOWN_OUTCOME, "; whether its turn was accepted is not known")
    return text.replace(UNKNOWN_OUTCOME, "") + outcome


def session_hint(error: PreposError, args: argparse.Namespace) -> str:
    """What to do about a refusal of the session's opening, in the command's flags (the server's own advice names
    the protocol's START and resume)."""
    if error.status is not None or not hasattr(args, "resume"):
        return ""
    if error.code == "ALREADY_EXISTS" and not args.resume:
        return " (to go on with that session, add --continue)"
    if error.field == "resume" and error.code == "NOT_FOUND" and args.resume:
        return " (without --continue, a new session opens under that id)"
    return ""


def unreachable_hint(error: PreposUnavailable, args: argparse.Namespace) -> str:
    """What to look at for a server that cannot be reached: a TLS handshake that failed is a server that speaks
    no TLS, or one that wants it, more likely than one that is down."""
    message = str(error).lower()
    tls = getattr(args, "tls", False) or getattr(args, "tls_ca", None) is not None
    if "hostname verification" in message or "is not in peer certificate" in message:
        return ("the server's certificate does not carry the host name of --url: give the name it carries with "
                "--tls-server-name")
    if "certificate_verify_failed" in message or "certificate verify failed" in message:
        return "the server's certificate is not trusted: give the certificate that signed it with --tls-ca"
    if "handshake" in message or "wrong_version_number" in message:
        return "the TLS handshake failed: does the server use TLS?" if tls else "the TLS handshake failed"
    if "ssl" in message or "tls" in message:
        return "a TLS problem (--tls, --tls-ca)?"
    if "expected settings frame" in message or "failed parsing http/2" in message:
        return ("the server there does not speak gRPC (HTTP/1: Triton's HTTP port, 8000 by default?); --url takes "
                "the gRPC port, 8001 by default")
    if message.endswith("socket closed"):  # what Triton's HTTP and metrics ports do with a gRPC connection
        hint = ("the server there closed the connection at once: is --url its gRPC port (8001 by default), not its "
                "HTTP (8000) or metrics (8002) one?")
        return hint if tls else hint + " A server with TLS closes a connection without it too: then add --tls"
    url = getattr(args, "url", "")
    if url and re.search(r":443(?!\d)", message) and not re.search(r":\d+$", url.rsplit("]", 1)[-1]):
        return "--url names no port, so gRPC tried 443; the server's gRPC port is 8001 unless set otherwise"
    return "is `make serve` running?"
