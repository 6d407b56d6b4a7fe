"""The request protocol: request/response dataclasses and input validation.

:func:`parse_request` is the one place a request's inputs are checked. It takes
the inputs as NumPy arrays keyed by input name (what the Triton adapter reads),
so it is testable without Triton. Every problem raises :class:`ProtocolError`,
which names the input and maps to a gRPC status.
"""

from __future__ import annotations

import enum
import json
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np

from prepos.config import LimitsConfig

INPUT_NAMES = (
    "text_input", "input_ids", "role", "max_tokens", "choices", "temperature", "top_p",
    "top_k", "seed", "stop", "speculate", "gate_threshold", "resume",
)
CONTROL_NAMES = ("START", "END")
_KNOWN_NAMES = frozenset(INPUT_NAMES + CONTROL_NAMES)


class Status(enum.Enum):
    """gRPC status codes the core uses (Triton's error codes map onto these)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"


# The Triton error code (a ``TritonError`` attribute of the Python backend) each status is sent as. The Python
# backend has no deadline code, and UNAVAILABLE tells a client to try again, as running out of KV memory does.
TRITON_ERROR_CODES = {
    Status.INVALID_ARGUMENT: "INVALID_ARG",
    Status.NOT_FOUND: "NOT_FOUND",
    Status.ALREADY_EXISTS: "ALREADY_EXISTS",
    Status.RESOURCE_EXHAUSTED: "UNAVAILABLE",
    Status.UNAVAILABLE: "UNAVAILABLE",
    Status.INTERNAL: "INTERNAL",
    Status.CANCELLED: "CANCELLED",
    Status.DEADLINE_EXCEEDED: "UNAVAILABLE",
}


def with_status(message: str, status: Status) -> str:
    """An error's message as clients receive it: the status follows in brackets
    (``max_tokens: must be in [0, 4096], got -1 [INVALID_ARGUMENT]``).

    A gRPC stream, the only way to a decoupled model, carries an error's message and no status, and Triton's HTTP
    generate endpoints answer 400 for a NOT_FOUND as for an INVALID_ARGUMENT; so the text is where every client can
    read it from. The status is the core's (``RESOURCE_EXHAUSTED``, ``DEADLINE_EXCEEDED``), not the Triton code it
    is sent as."""
    return f"{message} [{status.value}]"


def sent_status(message: str) -> Status | None:
    """The status an error's text ends with (:func:`with_status`), None when it ends with none: the text is not
    one prepos sent (Triton's own refusal, say)."""
    return next((status for status in Status if message.endswith(with_status("", status))), None)


def closed_all_the_same(err: ProtocolError) -> ProtocolError:
    """``err`` for a refused request that carried END (not START) on an open session: Triton ends the sequence at
    END whatever the model answers, so the session is closed, its journal deleted, and the error says so (a client
    reading only "max_tokens: ..." would take its session for open, refused "changes nothing")."""
    return ProtocolError(err.field, f"{err.problem}; the request carried END, so the session is closed all the same",
                         err.status)


def sequence_ended_all_the_same(err: ProtocolError) -> ProtocolError:
    """``err`` (``already open``) for a refused request that carried START and END: prepos keeps the open session
    as it was, but Triton ends its sequence at that END, so the session's next request must carry START and
    ``resume``, and the error says so (its owner's next request was refused as not started, naming neither)."""
    return ProtocolError(err.field, f"{err.problem}; the request carried END, so Triton ended the session's "
                                    "sequence all the same: its next request must carry START and resume (the session "
                                    "is kept as it was)", err.status)


def naming_request(message: str, request_id: str) -> str:
    """An error's message naming the request it answers (``... (request "4")``), for one sent ahead of the
    answers to the session's earlier requests: tritonclient hands a stream's error to its callback without the
    request id, so a client that matches errors to requests in the order sent would take it for an earlier
    request's. The id is a JSON string, just before the status."""
    return f"{message} (request {json.dumps(request_id)})"


def triton_error(error_type, message: str, status: Status):
    """The Python backend's error (``error_type``: its ``TritonError``, which only a backend stub can import) for a
    refusal: the message with its status (:func:`with_status`), sent as that status's Triton code."""
    return error_type(with_status(message, status), getattr(error_type, TRITON_ERROR_CODES[status]))


class ProtocolError(Exception):
    """A request the server will not serve. ``str(err)`` is ``"<field>: <problem>"``."""

    def __init__(self, field: str, problem: str, status: Status = Status.INVALID_ARGUMENT):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.status = status


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()  # what a request without sampling inputs gets; shared, it is frozen


@dataclass(slots=True)
class Request:
    """One validated request of a session. Fields are as sent, defaults applied; nothing changes them.

    Not frozen: a frozen dataclass's ``__init__`` costs several times more, on the path to every first token.
    """

    session_id: str | int
    request_id: str
    start: bool
    end: bool
    role: str
    max_tokens: int
    delta_text: str | None = None
    delta_ids: tuple[int, ...] | None = None
    choices: tuple[str, ...] | None = None
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()
    speculate: bool | None = None
    gate_threshold: float | None = None
    arrival_s: float = 0.0  # perf_counter() when the request reached the server
    deadline_s: float | None = None  # perf_counter() by which it must finish (the client's request timeout)
    resume: bool = False  # with START: continue the session this id names (reopen it from its journal if needed)
    drain: bool = False  # the END the server's own drain queues (prepos.drain.drain_end): the journal is kept

    @property
    def is_append(self) -> bool:
        return self.max_tokens == 0

    @property
    def has_delta(self) -> bool:
        return bool(self.delta_text) or bool(self.delta_ids)


END_REASON = "END"
"""Why a session closed by a client's END was closed."""
DRAIN_REASON = "drain"
"""Why a session closed by its drain END was closed: it keeps its journal (see :mod:`prepos.drain`)."""
START_REJECTED_REASON = "its START request was rejected"
"""Why a session whose opening request was refused when served was closed: it leaves nothing behind."""


def end_reason(request: Request) -> str:
    """Why an END request closes its session: ``END``, or :data:`DRAIN_REASON` for the drain's own END."""
    return DRAIN_REASON if request.drain else END_REASON


@dataclass(slots=True)
class ResponseChunk:
    """One streamed response. The last one of a request has a non-empty ``finish_reason``. Not frozen, like
    :class:`Request`: one is built per token."""

    text: str
    token_ids: tuple[int, ...]
    path: str
    confidence: float
    finish_reason: str
    queue_ms: float
    compute_ms: float
    first_token_ms: float
    prefill_ms: float = 0.0  # engine prefill time spent on this request so far
    decode_ms: float = 0.0  # engine decode time
    scan_ms: float = 0.0  # vocabulary scan time


@dataclass(frozen=True)
class Rejection:
    """A request that failed validation. It still takes its turn in the session's order: an END closes the session."""

    session_id: str | int
    start: bool
    end: bool
    error: ProtocolError


def control_flags(inputs: Mapping[str, np.ndarray]) -> tuple[bool, bool]:
    """START and END of a request whatever else is wrong with it (a malformed flag reads as unset)."""
    flags = []
    for name in CONTROL_NAMES:
        value = inputs.get(name)
        try:
            flags.append(value is not None and value.size == 1 and bool(value.reshape(-1)[0]))
        except (TypeError, ValueError):
            flags.append(False)
    return flags[0], flags[1]


class ResponseSink(Protocol):
    """Where a request's responses go. Every request gets exactly one final send."""

    def send(self, chunk: ResponseChunk, final: bool) -> None: ...

    def send_error(self, error: ProtocolError) -> None: ...

    def cancelled(self) -> bool:
        """Whether the client has gone (cancelled the request or closed the stream); may cost an IPC."""
        ...


CANCEL_POLL_INTERVAL_S = 0.05


class CancelPoll:
    """Asks ``is_cancelled`` at most once per ``interval_s`` (the first time at once); once it said yes, yes.

    Triton's ``is_cancelled`` is a round trip to the server (0.07-0.1 ms measured) that the engine loop waits
    for, and the decode loop asks for every session at every step: asked every time, a batch of 32 sessions
    would spend about 3 ms a step on it. A cancelled request stops within ``interval_s`` and the next step."""

    def __init__(self, is_cancelled: Callable[[], bool], interval_s: float = CANCEL_POLL_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._ask = is_cancelled
        self._interval_s = interval_s
        self._clock = clock
        self._next_s = float("-inf")
        self._cancelled = False

    def __call__(self) -> bool:
        if self._cancelled:
            return True
        now = self._clock()
        if now >= self._next_s:
            self._next_s = now + self._interval_s
            self._cancelled = bool(self._ask())
        return self._cancelled


def _scalar(inputs: Mapping[str, np.ndarray], name: str, kinds: str) -> bool | int | float | bytes | str | None:
    """The one value of input ``name`` as a Python object, checked for count and kind (None when absent)."""
    value = inputs.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise ProtocolError(name, f"expected one value, got shape {list(value.shape)}")
    if value.dtype.kind not in kinds:
        raise ProtocolError(name, f"wrong type {value.dtype}")
    return value.item()


def _utf8(name: str, raw: object, max_bytes: int, what: str = "") -> str:
    """Decode one BYTES element; its size is checked before it is decoded. ``what`` names the entry."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if not isinstance(raw, (bytes, np.bytes_)):
        raise ProtocolError(name, f"{what}expected bytes, got {type(raw).__name__}")
    if len(raw) > max_bytes:
        raise ProtocolError(name, f"{what}{len(raw)} bytes; at most {max_bytes} allowed")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ProtocolError(name, f"{what}not valid UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None


_MAX_DECODED_LISTS = 256
_decoded_lists: dict[tuple, tuple[str, ...]] = {}  # (max_bytes, *raw entries) -> the valid list they decode to


def _string_list(inputs: Mapping[str, np.ndarray], name: str, max_count: int, max_bytes: int) -> tuple[str, ...] | None:
    value = inputs.get(name)
    if value is None:
        return None
    if value.dtype.kind not in "OSU":
        raise ProtocolError(name, f"wrong type {value.dtype}; expected BYTES")
    items = value.reshape(-1).tolist()
    if len(items) > max_count:
        raise ProtocolError(name, f"{len(items)} entries; at most {max_count} allowed")
    key = (max_bytes, *items)  # clients send the same lists again and again (a session's tool names)
    try:
        decoded = _decoded_lists.get(key)
    except TypeError:  # an entry no BYTES tensor holds; named below
        decoded = None
    if decoded is not None:
        return decoded
    if all(type(raw) is bytes and 0 < len(raw) <= max_bytes for raw in items):
        try:  # the common case in one pass; any problem is named entry by entry below
            decoded = tuple([raw.decode("utf-8") for raw in items])
        except UnicodeDecodeError:
            pass
        else:
            if len(_decoded_lists) >= _MAX_DECODED_LISTS:
                _decoded_lists.clear()
            _decoded_lists[key] = decoded
            return decoded
    strings = []
    for i, raw in enumerate(items):
        text = _utf8(name, raw, max_bytes, f"entry {i}: ")
        if not text:
            raise ProtocolError(name, f"entry {i} is empty")
        strings.append(text)
    return tuple(strings)


def _finite(name: str, value: float | None, low: float, high: float, default: float, *,
            open_low: bool = False) -> float:
    """The input's value, checked to lie in [low, high] (``open_low``: (low, high]); ``default`` when absent."""
    if value is None:
        return default
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high or (open_low and number == low):
        raise ProtocolError(name, f"must be a finite number in {'(' if open_low else '['}{low}, {high}], got {number}")
    return number


_SAMPLING_NAMES = ("temperature", "top_p", "top_k", "seed")


def _sampling(inputs: Mapping[str, np.ndarray], limits: LimitsConfig) -> Sampling:
    sampling = Sampling(
        temperature=_finite("temperature", _scalar(inputs, "temperature", "f"), 0.0, 100.0, 0.0),
        top_p=_finite("top_p", _scalar(inputs, "top_p", "f"), 0.0, 1.0, 1.0, open_low=True),
        top_k=int(_scalar(inputs, "top_k", "iu") or 0),
        seed=None if (seed := _scalar(inputs, "seed", "iu")) is None else int(seed),
    )
    if not 0 <= sampling.top_k <= limits.max_top_k:
        raise ProtocolError("top_k", f"must be in [0, {limits.max_top_k}] (0 = no cut), got {sampling.top_k}")
    if sampling.seed is not None and not 0 <= sampling.seed < 2**64:
        raise ProtocolError("seed", f"must be in [0, 2**64), got {sampling.seed}")
    return sampling


def parse_request(
    inputs: Mapping[str, np.ndarray],
    *,
    session_id: str | int,
    request_id: str,
    limits: LimitsConfig,
    default_max_tokens: int,
    arrival_s: float = 0.0,
    timeout_s: float | None = None,
) -> Request:
    """Validate one request's inputs and build a :class:`Request`.

    ``inputs`` maps input names (including the ``START``/``END`` controls) to
    arrays. Raises :class:`ProtocolError` naming the first bad input. Checks
    that need the model (token id range, context length, role framing) happen
    where the session is served, with the same error type.
    """
    unknown = inputs.keys() - _KNOWN_NAMES
    if unknown:
        name = sorted(unknown)[0]
        raise ProtocolError(name, "unknown input")
    if session_id in (None, "", 0):
        raise ProtocolError("correlation_id", "a session id (sequence id) is required")

    start = _scalar(inputs, "START", "biuf")
    end = _scalar(inputs, "END", "biuf")

    text_raw = _scalar(inputs, "text_input", "OSU")
    delta_text = None
    if text_raw is not None:
        delta_text = _utf8("text_input", text_raw, limits.max_delta_bytes)

    delta_ids = None
    ids = inputs.get("input_ids")
    if ids is not None:
        if delta_text is not None:
            raise ProtocolError("input_ids", "exclusive with text_input; send one of them")
        if ids.dtype.kind not in "iu":
            raise ProtocolError("input_ids", f"wrong type {ids.dtype}; expected INT32")
        if ids.size > limits.max_delta_tokens:
            raise ProtocolError("input_ids", f"{ids.size} token ids; at most {limits.max_delta_tokens} allowed")
        delta_ids = tuple(int(i) for i in ids.reshape(-1))
        if any(i < 0 for i in delta_ids):
            raise ProtocolError("input_ids", "token ids must be >= 0")

    role_raw = _scalar(inputs, "role", "OSU")
    role = "user" if role_raw is None else _utf8("role", role_raw, limits.max_role_bytes)

    max_tokens_raw = _scalar(inputs, "max_tokens", "iu")
    if max_tokens_raw is not None:
        max_tokens = int(max_tokens_raw)
    else:  # a request with nothing to answer (a bare START or END) is an update, not a question about nothing
        bare = delta_text is None and delta_ids is None and "choices" not in inputs
        max_tokens = 0 if bare else default_max_tokens
    if not 0 <= max_tokens <= limits.max_tokens:
        raise ProtocolError("max_tokens", f"must be in [0, {limits.max_tokens}], got {max_tokens}")

    choices = _string_list(inputs, "choices", limits.max_choices, limits.max_choice_bytes)
    if choices is not None:
        if not choices:
            raise ProtocolError("choices", "empty list; send at least one choice or leave the input out")
        if len(set(choices)) != len(choices):
            raise ProtocolError("choices", "duplicate entries")
        if max_tokens == 0:
            raise ProtocolError("choices", "needs max_tokens >= 1 (max_tokens=0 is an append)")
    stop = _string_list(inputs, "stop", limits.max_stops, limits.max_stop_bytes) or ()

    sampling = GREEDY if inputs.keys().isdisjoint(_SAMPLING_NAMES) else _sampling(inputs, limits)

    speculate = _scalar(inputs, "speculate", "b")
    resume = _scalar(inputs, "resume", "b")
    if resume is not None and bool(resume) and not (start is not None and bool(start)):
        raise ProtocolError("resume", "needs START: a resumed session's first request opens it on this server")
    gate_threshold = _scalar(inputs, "gate_threshold", "f")
    return Request(
        session_id=session_id,
        request_id=request_id,
        start=bool(start) if start is not None else False,
        end=bool(end) if end is not None else False,
        role=role,
        max_tokens=max_tokens,
        delta_text=delta_text,
        delta_ids=delta_ids,
        choices=choices,
        sampling=sampling,
        stop=stop,
        speculate=None if speculate is None else bool(speculate),
        gate_threshold=None if gate_threshold is None else _finite("gate_threshold", gate_threshold, 0.0, 1.0, 0.0),
        arrival_s=arrival_s,
        deadline_s=arrival_s + timeout_s if timeout_s else None,
        resume=resume is not None and bool(resume),
    )
