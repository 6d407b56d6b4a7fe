"""Errors raised by the prepos client.

Every failure the server reports reaches the caller as a `PreposError`; the
two conditions a caller usually handles differently (the server cannot be
reached, a call ran out of time) have their own subclasses.
"""

from __future__ import annotations

import contextlib
import json
import re

from tritonclient.utils import InferenceServerException

# Triton prefixes errors raised while it normalizes a request (before the
# model sees it) with the request id; the field name follows that prefix.
_REQUEST_ID_PREFIX = re.compile(r"^\[request id: ([^\]]*)\]\s*")
# Input names are snake_case; Triton's control inputs are upper case (START).
_FIELD_PREFIX = re.compile(r"^([a-z][a-z0-9_]*|[A-Z][A-Z0-9_]*)\s*:")

# gRPC codes that mean "no server answered", as tritonclient spells them.
_UNREACHABLE_STATUSES = frozenset({"StatusCode.UNAVAILABLE"})
# The statuses prepos names at the end of its error messages ("... [NOT_FOUND]"): a gRPC stream carries an
# error's text and no status, so the server writes it into the text.
CODES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                   "INTERNAL", "CANCELLED", "DEADLINE_EXCEEDED"})
_CODE_SUFFIX = re.compile(r" \[([A-Z_]+)\]\Z")
# The request an error sent out of order names, as a JSON string, at the end of its text (before the status).
_NAMED_REQUEST = re.compile(r' \(request ("(?:[^"\\]|\\.)*")\)\Z')


class PreposError(Exception):
    """A request failed on the server or on its way there.

    Attributes:
        message: the server's message, without Triton's request-id prefix.
        field: the request input the message names (`max_tokens` for
            "max_tokens: must be >= 0, got -1"), or None when it names none.
        status: the gRPC status of a stream-level failure as tritonclient
            reports it (e.g. "StatusCode.UNAVAILABLE"); None for an error the
            model returned for one request.
        code: the status the server gave a refusal ("NOT_FOUND",
            "RESOURCE_EXHAUSTED", one of `CODES`), read from the end of its
            message and taken off it; None for Triton's own refusals and for
            failures on the way.
    """

    def __init__(self, message: str, *, field: str | None = None, status: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status
        self.code = code

    def reworded(self, message: str) -> PreposError:
        """The same refusal told in ``message`` (its field, status and code kept)."""
        return PreposError(message, field=self.field, status=self.status, code=self.code)

    def __str__(self) -> str:
        return self.message


class PreposUnavailable(PreposError):
    """The server could not be reached (connection refused, DNS, TLS, shutdown)."""


class PreposTimeout(PreposError, TimeoutError):
    """A call did not complete within its timeout.

    The timeout went with the request (Triton's request timeout, less a margin
    for the answer's way back: a tenth of it, at most 50 ms), so the server
    stops it at its deadline, accepts no turn past it, and its error is what
    the call raises (field ``timeout``). If the client's own limit runs out
    first, the outcome is not known yet: nothing was accepted unless a final
    response sent before the server's deadline took longer than the margin to
    arrive. The session stays usable; its next call (or `Session.settle`)
    first waits, within its own time limit, for the server's answer to the
    request that timed out, and records it in ``accepted``. If that request
    was the one to open the session (START), the answer also tells whether
    the session is open: after the deadline error the next request carries
    START again.

    Attributes:
        accepted: whether the request's turn was accepted: False when the
            server stopped it (or it was never sent), True when its final
            response came after the client gave up, None while that is not
            known (or cannot be: the stream ended, or the client's own limit
            ran out on a request that carried END, which closed the session).
    """

    def __init__(self, message: str, *, field: str | None = None, status: str | None = None,
                 code: str | None = None, accepted: bool | None = None):
        super().__init__(message, field=field, status=status, code=code)
        self.accepted = accepted

    def reworded(self, message: str) -> PreposTimeout:
        return PreposTimeout(message, field=self.field, status=self.status, code=self.code, accepted=self.accepted)


def parse_field(message: str) -> str | None:
    """Return the input name a server error message starts with, or None.

    The server names the offending field before a colon
    ("top_k: must be >= 0, got -3"); Triton's own "[request id: X] " prefix
    is skipped. Messages that do not start with a snake_case or upper-case
    identifier and a colon name no field.
    """
    match = _FIELD_PREFIX.match(_REQUEST_ID_PREFIX.sub("", message, count=1))
    return match.group(1) if match else None


def split_code(message: str) -> tuple[str, str | None]:
    """A server error message without the status it ends with (``"... [NOT_FOUND]"``), and that status; the
    message unchanged and None when it ends with none of `CODES`."""
    match = _CODE_SUFFIX.search(message)
    if match is None or match.group(1) not in CODES:
        return message, None
    return message[:match.start()], match.group(1)


def named_request(message: str) -> str | None:
    """The request id a server error names at its end (``... (request "4")``, before its status, if any): one the
    server sent ahead of the answers to the session's earlier requests (a queued request's deadline); else None."""
    match = _NAMED_REQUEST.search(split_code(message)[0])
    if match is None:
        return None
    with contextlib.suppress(ValueError):
        request_id = json.loads(match.group(1))
        return request_id if isinstance(request_id, str) else None
    return None


def request_id_of(message: str) -> str | None:
    """The request an error's text names: Triton's own ``[request id: X]`` prefix, or prepos's
    (:func:`named_request`); None when it names none."""
    match = _REQUEST_ID_PREFIX.match(message)
    return match.group(1) if match and match.group(1) else named_request(message)


def from_triton(error: InferenceServerException) -> PreposError:
    """Convert a tritonclient exception into the matching `PreposError`."""
    message = error.message() or str(error)
    status = error.status()
    if "protocol is restricted" in message:  # Triton's answer to a missing or wrong access token
        return PreposError(f"access token: missing or wrong (give it with token=, --token or PREPOS_ACCESS_TOKEN); "
                           f"the server said: {message}", field="access token", status=status)
    if status in _UNREACHABLE_STATUSES:
        return PreposUnavailable(message, status=status)
    if status == "StatusCode.DEADLINE_EXCEEDED":
        return PreposTimeout(message, status=status)
    message, field = _REQUEST_ID_PREFIX.sub("", message, count=1), parse_field(message)
    message, code = split_code(message)
    if field == "timeout" and "deadline" in message:  # the server stopped the call at its time limit
        return PreposTimeout(message, field=field, status=status, code=code, accepted=False)
    return PreposError(message, field=field, status=status, code=code)
