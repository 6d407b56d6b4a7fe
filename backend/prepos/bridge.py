"""The HTTP bridge (Triton model ``prepos_http``): the session as an input instead of the correlation id.

Triton's generate endpoints (``/v2/models/<model>/generate`` and
``generate_stream``) map a JSON body onto a model's inputs but set no
correlation id, and its ``/infer`` endpoint serves no decoupled model, so
``prepos`` cannot be called over HTTP. ``prepos_http`` takes the session as
inputs and forwards every request to ``prepos`` (Business Logic Scripting) with
that correlation id and the sequence flags, relaying prepos's responses:

- ``session_id`` (BYTES [1]): the session (a string correlation id). Absent: a
  one-turn session with an id of its own, opened and closed by the request.
- ``start``, ``end`` (BOOL [1]): open or close the named session with this request.
- ``stream`` (BOOL [1]): relay every response as prepos sends it; without it the
  responses are merged into one (what ``/generate`` returns).

Outputs are prepos's, except that a number a response leaves unset (NaN in
prepos's responses, such as an update's confidence) is left out, since the
generate endpoints would write it as ``NaN``, which JSON does not allow.

Every other input is prepos's own and passes through unchanged, so prepos checks
it and names a bad one. This module holds the bridge's logic on NumPy values;
``model_repository/prepos_http/1/model.py`` only converts.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prepos.protocol import ProtocolError

BRIDGE_INPUTS = ("session_id", "start", "end", "stream")
MAX_SESSION_ID_BYTES = 256
ONE_TURN_PREFIX = "http-"

# How the merged response takes each output from the responses of one request (clients' reading of a stream):
_CONCATENATED = ("text_output", "output_ids")
_FROM_FIRST = ("path", "confidence", "queue_ms", "first_token_ms", "prefill_ms", "decode_ms", "scan_ms")
_FROM_LAST = ("finish_reason", "compute_ms")


@dataclass(frozen=True)
class Target:
    """Where a bridged request goes: the session (correlation id) and its sequence flags."""

    session_id: str
    start: bool
    end: bool
    stream: bool


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool | None:
    value = inputs.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise ProtocolError(name, f"expected one value, got shape {list(value.shape)}")
    if value.dtype.kind != "b":
        raise ProtocolError(name, f"wrong type {value.dtype}; expected BOOL")
    return bool(value.item())


def _session_id(inputs: Mapping[str, np.ndarray]) -> str | None:
    value = inputs.get("session_id")
    if value is None:
        return None
    if value.size != 1:
        raise ProtocolError("session_id", f"expected one value, got shape {list(value.shape)}")
    if value.dtype.kind not in "OSU":
        raise ProtocolError("session_id", f"wrong type {value.dtype}; expected BYTES")
    raw = value.reshape(-1)[0]
    if isinstance(raw, str):
        raw = raw.encode("utf-8")
    if not isinstance(raw, bytes):
        raise ProtocolError("session_id", f"expected a string, got {type(raw).__name__}")
    if len(raw) > MAX_SESSION_ID_BYTES:
        raise ProtocolError("session_id", f"{len(raw)} bytes; at most {MAX_SESSION_ID_BYTES} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProtocolError("session_id", f"not valid UTF-8 ({err.reason} at byte {err.start})") from None
    if not text:
        raise ProtocolError("session_id", "empty; leave it out for a one-turn session")
    if text.startswith(ONE_TURN_PREFIX):
        raise ProtocolError("session_id", f"ids starting {ONE_TURN_PREFIX!r} are the bridge's one-turn sessions")
    return text


def bridge_target(inputs: Mapping[str, np.ndarray]) -> Target:
    """The session and flags of a bridged request; :class:`ProtocolError` naming the input that is wrong."""
    session_id = _session_id(inputs)
    start, end, stream = (_flag(inputs, name) for name in ("start", "end", "stream"))
    if session_id is None:
        if start is not None or end is not None:
            given = "start" if start is not None else "end"
            raise ProtocolError(given, "needs session_id (without it the request is a one-turn session, "
                                       "opened and closed by itself)")
        return Target(ONE_TURN_PREFIX + uuid.uuid4().hex, True, True, bool(stream))
    return Target(session_id, bool(start), bool(end), bool(stream))


def forwarded_inputs(names: Sequence[str]) -> list[str]:
    """The inputs that go on to prepos: every one but the bridge's own."""
    return [name for name in names if name not in BRIDGE_INPUTS]


def absent_outputs(outputs: Mapping[str, np.ndarray]) -> list[str]:
    """Names of the one-value number outputs a response leaves unset (prepos sends NaN, e.g. the confidence of
    an update). The bridge leaves them out: the generate endpoints would write NaN, which is not JSON."""
    return [name for name, value in outputs.items()
            if value.size == 1 and value.dtype.kind == "f" and np.isnan(value.reshape(-1)[0])]


def merge_responses(responses: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One response from a request's responses, in order: the text and token ids joined; path, confidence and the
    first token's timings from the first response; finish reason and engine time from the last; outputs no
    response set left out (:func:`absent_outputs`). Responses with no outputs (a final flag alone) are skipped;
    none at all gives ``{}``."""
    responses = [r for r in responses if r]
    if not responses:
        return {}
    merged: dict[str, np.ndarray] = {}
    for name in responses[0]:
        values = [r[name] for r in responses if name in r]
        if name == "text_output":
            text = b"".join(_as_bytes(v.reshape(-1)[0]) for v in values if v.size)
            merged[name] = np.array([text], dtype=np.object_)
        elif name in _CONCATENATED:
            merged[name] = np.concatenate([v.reshape(-1) for v in values])
        elif name in _FROM_LAST:
            merged[name] = next((v for v in reversed(values) if _present(v)), values[-1])
        else:  # _FROM_FIRST, and any output added later
            merged[name] = next((v for v in values if _present(v)), values[0])
    for name in absent_outputs(merged):
        del merged[name]
    return merged


def _as_bytes(raw: object) -> bytes:
    return raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)


def _present(value: np.ndarray) -> bool:
    """Whether a one-value output carries something: a non-empty string, or a number a response set."""
    if value.size == 0:
        return False
    item = value.reshape(-1)[0]
    if isinstance(item, (bytes, str)):
        return len(item) > 0
    return not (isinstance(item, float) and np.isnan(item))
