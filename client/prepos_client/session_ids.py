"""Session ids: fresh ones, and which ones the server and a gRPC header can carry."""

from __future__ import annotations

import uuid

import numpy as np

# tritonclient sends an integer sequence id as an int64 request parameter.
_MAX_INT_SESSION_ID = 2**63 - 1
MAX_SESSION_ID_CHARS = 128  # Triton refuses a longer string correlation id


def new_session_id() -> str:
    """A fresh random opaque session id."""
    return uuid.uuid4().hex


def check_session_id(session_id: str | int) -> str | int:
    """Return `session_id` if the server and a gRPC header can carry it.

    Raises:
        ValueError: an empty or non-printable-ASCII string (it also travels
            as the `prepos-session-id` header), one longer than 128
            characters (Triton's limit), or an int outside
            [1, 2**63 - 1] (0 means "no sequence" to Triton).
        TypeError: neither str nor int.
    """
    if isinstance(session_id, bool) or not isinstance(session_id, (str, int, np.integer)):
        raise TypeError(f"session_id: expected str or int, got {type(session_id).__name__}")
    if isinstance(session_id, str):
        if not session_id or not all(" " <= char <= "~" for char in session_id):
            raise ValueError(f"session_id: expected a non-empty printable ASCII string, got {session_id!r}")
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise ValueError(f"session_id: {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS} allowed "
                             "(Triton's limit for a string correlation id)")
        return session_id
    if not 1 <= int(session_id) <= _MAX_INT_SESSION_ID:
        raise ValueError(f"session_id: an integer id must be in [1, 2**63 - 1], got {session_id}")
    return int(session_id)
