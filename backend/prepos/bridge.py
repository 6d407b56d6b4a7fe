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
- the request parameter ``timeout`` (microseconds, Triton's name for a request
  timeout): the generate endpoints set no request timeout, and pass a body key
  that is no input on as a request parameter; the bridge hands it (or the
  request's own timeout, set over gRPC) on to prepos, which ends the request
  with an error naming ``timeout`` once it has passed.

An error prepos sends after other responses of the request (a deadline passing
mid-answer, say) never reaches a Business Logic Scripting caller in the Triton
this project runs (its Python backend files such an error under no request, and
the caller waits forever), so prepos sends it to the bridge as a final response
of outputs instead (:func:`relayed_error_outputs`, only to requests carrying the
request parameter :data:`BRIDGE_PARAMETER`), and the bridge turns it back into
the error (:func:`relayed_error`).

Outputs are prepos's, except that a number a response leaves unset (NaN in
prepos's responses, such as an update's confidence) is left out, since the
generate endpoints would write it as ``NaN``, which JSON does not allow.

Every other input is prepos's own and passes through, so prepos checks it and
names a bad one; prepos's INT32 inputs (:data:`NARROWED_INPUTS`) are INT64 on
the bridge, because the generate endpoints store a JSON number into an INT32
input by truncation (4294967299 arrives as 3): the bridge reads the whole value
and names the input when it does not fit INT32. This module holds the bridge's
logic on NumPy values; ``model_repository/prepos_http/1/model.py`` only converts.

Refusals are counted in ``prepos_request_errors_total`` under the bridge's model:
its own, and Triton's of the requests it relays (:func:`triton_refusal`), which
prepos never sees; prepos counts its own refusals of relayed requests.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prepos.config import check_setting, read_settings
from prepos.protocol import ProtocolError, Status, sent_status

BRIDGE_INPUTS = ("session_id", "start", "end", "stream")
CHECKED_INPUTS = (*BRIDGE_INPUTS, "resume")  # what bridge_target reads: resume needs a session too
MAX_SESSION_ID_BYTES = 128  # Triton's limit on a string correlation id
ONE_TURN_PREFIX = "http-"
# prepos's INT32 inputs, INT64 on the bridge (module docstring): the type prepos takes each as.
NARROWED_INPUTS = {"input_ids": np.int32, "max_tokens": np.int32, "top_k": np.int32}
# Every field the bridge counts a refusal under (its inputs, those it checks, the timeout parameter, START for a
# relayed request Triton refused for a session it does not hold, "request" for any other failure: triton_refusal),
# in prepos_request_errors_total{model="prepos_http"}, each published at 0 from the start.
PARAMETERS = ("timeout",)
"""The request parameters the bridge reads; any other is refused (a misspelt input, which the generate endpoints
pass as a parameter, would otherwise be ignored: ``maxtokens`` left the answer at its default length)."""
ERROR_FIELDS = (*CHECKED_INPUTS, *NARROWED_INPUTS, *PARAMETERS, "parameters", "START", "request")

# The bridge's settings: model parameters in its config.pbtxt, each overridable by PREPOS_BRIDGE_<FIELD>.
DEFAULT_TARGET_MODEL = "prepos"
DEFAULT_MAX_STREAMS = 256


def target_in_repository(model_dir: str, target_model: str) -> bool:
    """Whether the bridge's repository (the folder above ``model_dir``, its own model folder) holds
    ``target_model``; models load side by side, so whether it is ready cannot be asked at the bridge's load."""
    return os.path.isfile(os.path.join(os.path.dirname(model_dir.rstrip("/")), target_model, "config.pbtxt"))


@dataclass(frozen=True)
class BridgeConfig:
    target_model: str = DEFAULT_TARGET_MODEL  # the model requests are relayed to
    max_streams: int = DEFAULT_MAX_STREAMS  # requests relayed at once (one thread each); more wait for a thread

    def __post_init__(self) -> None:
        check_setting(bool(self.target_model), "bridge.target_model", "empty")
        check_setting(self.max_streams >= 1, "bridge.max_streams", f"must be at least 1, got {self.max_streams}")


def read_bridge_config(parameters: Mapping[str, str], environ: Mapping[str, str]) -> BridgeConfig:
    """The bridge's settings from its model parameters (``bridge.<field>``) and the environment
    (``PREPOS_BRIDGE_<FIELD>``, which wins), as prepos's own are read; ConfigError naming the key, and the
    variable that set it."""
    return read_settings({"bridge": BridgeConfig}, parameters, environ, lambda bridge: bridge)


# The request parameter the bridge sets on what it forwards, and the path of the response carrying an error then.
BRIDGE_PARAMETER = "prepos_bridge"
RELAYED_ERROR_PATH = b"error"

# How the merged response takes each output from the responses of one request (clients' reading of a stream):
_CONCATENATED = ("text_output", "output_ids")
_FROM_FIRST = ("path", "confidence", "queue_ms", "first_token_ms")
# The engine time by phase is the request's so far on every response: the last one's is the whole request's,
# beside its compute_ms (the first's held the first token's alone: decode_ms 0 for every merged answer).
_FROM_LAST = ("finish_reason", "compute_ms", "prefill_ms", "decode_ms", "scan_ms")


@dataclass(frozen=True)
class Target:
    """Where a bridged request goes: the session (correlation id), its sequence flags and the time limit."""

    session_id: str
    start: bool
    end: bool
    stream: bool
    timeout_us: int = 0  # the request's time limit in microseconds; 0: none

    def timeout_us_left(self, waited_s: float) -> int:
        """The time limit to pass on after ``waited_s`` seconds in the bridge (0: none). At least 1: a request
        whose time is up still goes on, and prepos answers it with its own error naming ``timeout``."""
        if not self.timeout_us:
            return 0
        return max(1, self.timeout_us - int(waited_s * 1e6))


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
    if "\0" in text:  # Triton ends a string correlation id at its first NUL: "a\0b" would be session "a"
        raise ProtocolError("session_id", f"contains a NUL character (at byte {raw.index(0)}), which ends an id in "
                            "Triton: another id's session would be reached")
    if text.startswith(ONE_TURN_PREFIX):
        raise ProtocolError("session_id", f"ids starting {ONE_TURN_PREFIX!r} are the bridge's one-turn sessions")
    return text


def request_parameters(read: Callable[[], str]) -> str:
    """The request's parameters as Triton's JSON text, from ``read`` (the stub's ``request.parameters``), which
    fails to decode a body key that is not an input, or such a key's string value, that is not UTF-8:
    :class:`ProtocolError` naming ``parameters`` then, where the stub's error named nothing."""
    try:
        return read()
    except UnicodeDecodeError as err:
        raise ProtocolError("parameters", f"not valid UTF-8 (byte 0x{err.object[err.start]:02x} at offset "
                                          f"{err.start} of the parameters' JSON): a body key that is not an input, "
                                          "or its value, must be UTF-8") from None


def _parameters(parameters: str) -> dict:
    """The request's parameters (Triton's JSON object); :class:`ProtocolError` naming ``parameters`` for a key the
    bridge does not read (the key in the message; the field is fixed, as it labels a metric)."""
    try:
        found = json.loads(parameters or "{}")
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return {}  # Triton always writes a JSON object; anything else holds nothing to read
    unknown = sorted(set(found) - set(PARAMETERS))
    if unknown:
        raise ProtocolError("parameters", f"unknown key {', '.join(map(json.dumps, unknown))}: neither an input of "
                            f"the bridge or of prepos nor a parameter the bridge reads ({', '.join(PARAMETERS)}); "
                            "a misspelt input?")
    return found


def _timeout_us(found: dict, request_timeout_us: int) -> int:
    value = found.get("timeout")
    if value is None:
        return request_timeout_us
    if isinstance(value, bool) or not isinstance(value, int):
        # Triton hands on an integer past int64 as a float: 99999999999999999999 arrives as 1e+20
        raise ProtocolError("timeout", f"expected whole microseconds (a JSON integer, at most 2**63 - 1), got "
                                       f"{json.dumps(value)}")
    if value < 0:
        raise ProtocolError("timeout", f"must be >= 0 microseconds (0: none), got {value}")
    return min((t for t in (value, request_timeout_us) if t), default=0)


def bridge_target(inputs: Mapping[str, np.ndarray], parameters: str = "{}", request_timeout_us: int = 0) -> Target:
    """The session, flags and time limit of a bridged request; :class:`ProtocolError` naming the input that is
    wrong. ``parameters`` is the request's parameters as Triton's JSON (the generate endpoints put a body key
    that is no input there); ``request_timeout_us`` is Triton's own request timeout (0: none). The time limit is
    the smaller of the ``timeout`` parameter and the request timeout that are set."""
    session_id = _session_id(inputs)
    start, end, stream = (_flag(inputs, name) for name in ("start", "end", "stream"))
    timeout_us = _timeout_us(_parameters(parameters), request_timeout_us)
    if session_id is None:
        if start is not None or end is not None:
            given = "start" if start is not None else "end"
            value = start if start is not None else end
            # false too: a one-turn session is opened and closed by its request whatever the flags say
            raise ProtocolError(given, f"{str(value).lower()} needs session_id (without it the request is a "
                                       "one-turn session, opened and closed by itself: leave start and end out)")
        if inputs.get("resume") is not None:
            raise ProtocolError("resume", "needs session_id: the session to resume (without it the request is a "
                                          "new one-turn session, which has nothing to resume)")
        return Target(ONE_TURN_PREFIX + uuid.uuid4().hex, True, True, bool(stream), timeout_us)
    return Target(session_id, bool(start), bool(end), bool(stream), timeout_us)


def narrowed_inputs(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The :data:`NARROWED_INPUTS` among ``inputs``, as the type prepos takes (same shape, same values);
    :class:`ProtocolError` naming the input, and the entry of a list, whose value does not fit that type."""
    narrowed = {}
    for name, value in inputs.items():
        target = NARROWED_INPUTS.get(name)
        if target is None:
            continue
        if value.dtype.kind not in "iu":
            raise ProtocolError(name, f"wrong type {value.dtype}; expected an integer type")
        limits = np.iinfo(target)
        flat = value.reshape(-1)
        outside = np.flatnonzero((flat < limits.min) | (flat > limits.max))
        if outside.size:
            where = f"entry {outside[0]}, " if name == "input_ids" else ""
            raise ProtocolError(name, f"{where}{int(flat[outside[0]])} does not fit {np.dtype(target).name.upper()} "
                                      f"[{limits.min}, {limits.max}]")
        narrowed[name] = value.astype(target)
    return narrowed


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
    first token's timings from the first response; finish reason and engine time (in all and by phase) from the
    last; outputs no response set left out (:func:`absent_outputs`). Responses with no outputs (a final flag
    alone) are skipped; none at all gives ``{}``."""
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


def relayed_error_outputs(error: ProtocolError) -> dict[str, np.ndarray]:
    """prepos's outputs carrying ``error`` to the bridge: the path ``error``, the status as the finish reason and
    the message as the text."""
    return {
        "text_output": np.array([str(error).encode("utf-8")], dtype=np.object_),
        "path": np.array([RELAYED_ERROR_PATH], dtype=np.object_),
        "finish_reason": np.array([error.status.value.encode()], dtype=np.object_),
    }


def relayed_error(outputs: Mapping[str, np.ndarray]) -> tuple[str, Status] | None:
    """The error (message and status) a response of :func:`relayed_error_outputs` carries; None for any other."""
    path = outputs.get("path")
    if path is None or path.size != 1 or _as_bytes(path.reshape(-1)[0]) != RELAYED_ERROR_PATH:
        return None
    message = _as_bytes(outputs["text_output"].reshape(-1)[0]).decode("utf-8", errors="replace")
    return message, Status(_as_bytes(outputs["finish_reason"].reshape(-1)[0]).decode())


TRITON_NOT_OPEN = "must specify the START flag on the first request of the sequence"
"""How Triton (2.51) words its refusal of a request without START for a sequence it does not hold."""


def triton_refusal(message: str) -> tuple[str, Status | None] | None:
    """For an error of a relayed request: None when prepos sent it (its text ends with a status, see
    ``prepos.protocol.with_status``; prepos counts it), else Triton refused the request before prepos saw it, and
    this is the field the bridge counts it under and the status it adds to the text. A request to a session Triton
    does not hold (never opened, ended, or idle past the timeout) is ``("START", NOT_FOUND)``, as prepos words a
    session that is not open; any other is ``("request", None)``, passed on as Triton wrote it."""
    if sent_status(message) is not None:
        return None
    if TRITON_NOT_OPEN in message:
        return "START", Status.NOT_FOUND
    return "request", None


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
