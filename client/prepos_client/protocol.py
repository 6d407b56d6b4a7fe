"""The `prepos` model's wire protocol: request inputs and streamed responses.

`build_inputs` turns Python arguments into Triton inputs; `parse_chunk` turns
one streamed response into a `Chunk`; `Answer` and `Update` summarize the
chunks of a generate request and of an append (or close) request.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from tritonclient.grpc import InferInput, InferResult

# Input name -> Triton datatype. The names are the server's contract.
INPUT_DATATYPES: dict[str, str] = {
    "text_input": "BYTES",
    "input_ids": "INT32",
    "role": "BYTES",
    "max_tokens": "INT32",
    "choices": "BYTES",
    "temperature": "FP32",
    "top_p": "FP32",
    "top_k": "INT32",
    "seed": "UINT64",
    "stop": "BYTES",
    "speculate": "BOOL",
    "gate_threshold": "FP32",
    "resume": "BOOL",
}

OUTPUT_NAMES = (
    "text_output",
    "output_ids",
    "path",
    "confidence",
    "finish_reason",
    "queue_ms",
    "compute_ms",
    "first_token_ms",
    "prefill_ms",
    "decode_ms",
    "scan_ms",
)

# Set by Triton on every streamed response of a decoupled model: true on the
# response sent with COMPLETE_FINAL, including flags-only ones.
FINAL_RESPONSE_PARAMETER = "triton_final_response"

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_UINT64_MAX = 2**64 - 1


def build_inputs(
    text: str | None = None,
    *,
    ids: Sequence[int] | np.ndarray | None = None,
    role: str | None = None,
    max_tokens: int | None = None,
    choices: Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    speculate: bool | None = None,
    gate_threshold: float | None = None,
) -> list[InferInput]:
    """Build the Triton inputs of one request.

    Only the arguments that are not None become inputs, so the server's
    defaults apply to the rest. `text` and `ids` are the delta (at most one
    of them); strings are sent UTF-8 encoded. Values are checked only as far
    as their encoding needs (a token id must fit INT32, a seed UINT64); range
    and meaning are the server's to check, and it names the field it rejects.

    Raises:
        ValueError: both `text` and `ids` given, or a value that does not fit
            its input's datatype.
        TypeError: a value of the wrong kind (e.g. `choices` given as one str).
    """
    if text is not None and ids is not None:
        raise ValueError("text_input, input_ids: give the delta as text or as token ids, not both")
    inputs: list[InferInput] = []
    if text is not None:
        inputs.append(_bytes_input("text_input", [_require_str("text_input", text)]))
    if ids is not None:
        inputs.append(_int32_input("input_ids", ids))
    if role is not None:
        inputs.append(_bytes_input("role", [_require_str("role", role)]))
    if max_tokens is not None:
        inputs.append(_int32_input("max_tokens", [max_tokens]))
    if choices is not None:
        inputs.append(_bytes_input("choices", _str_list("choices", choices, allow_str=False)))
    if temperature is not None:
        inputs.append(_scalar_input("temperature", _fp32("temperature", temperature)))
    if top_p is not None:
        inputs.append(_scalar_input("top_p", _fp32("top_p", top_p)))
    if top_k is not None:
        inputs.append(_int32_input("top_k", [top_k]))
    if seed is not None:
        inputs.append(_scalar_input("seed", np.uint64(_uint64("seed", seed))))
    if stop is not None:
        inputs.append(_bytes_input("stop", _str_list("stop", stop, allow_str=True)))
    if speculate is not None:
        inputs.append(_scalar_input("speculate", np.bool_(_require_bool("speculate", speculate))))
    if gate_threshold is not None:
        inputs.append(_scalar_input("gate_threshold", _fp32("gate_threshold", gate_threshold)))
    return inputs


def resume_input() -> InferInput:
    """The `resume` input: with START, reopen the session this id names (from the server's journal when the
    server does not hold it) instead of starting a new one."""
    return _scalar_input("resume", np.bool_(True))


def is_number(value: object) -> bool:
    """An int or a float (NumPy's too), not a bool: NumPy would read a str ("0.5") or a bool as a number, hiding
    the caller's mistake."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _number(name: str, value: object) -> float:
    if not is_number(value):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    return float(value)


def _fp32(name: str, value: object) -> np.float32:
    """``value`` as the FP32 its input carries; ValueError for a finite number past FP32's range (NumPy made it
    infinity, with a RuntimeWarning, and the server's refusal then named a value the caller never gave)."""
    number = _number(name, value)
    with np.errstate(over="ignore"):
        cast = np.float32(number)
    if math.isfinite(number) and not np.isfinite(cast):
        raise ValueError(f"{name}: {number!r} is past the range of FP32, the input's datatype")
    return cast


def _require_bool(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__}")
    return bool(value)


def _require_str(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected str, got {type(value).__name__}")
    return value


def _str_list(name: str, values: str | Iterable[str], *, allow_str: bool) -> list[str]:
    if isinstance(values, str):
        if not allow_str:
            raise TypeError(f"{name}: give a list of strings, not one str")
        return [values]
    return [_require_str(name, value) for value in values]


def _bytes_input(name: str, values: list[str]) -> InferInput:
    array = np.array([_utf8(name, value) for value in values], dtype=np.object_)
    return _tensor_input(name, array)


def _utf8(name: str, value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as err:  # lone surrogates: bytes that were no UTF-8 where the text was read
        raise ValueError(f"{name}: not valid UTF-8 text ({err.reason}: {value[err.start:err.end]!r} at character "
                         f"{err.start}, bytes that were not UTF-8 where it was read)") from None


def _int32_input(name: str, values: Sequence[int] | np.ndarray) -> InferInput:
    # Check the range before narrowing: numpy would wrap an out-of-range value
    # into INT32 silently, and the server could not tell it was ever different.
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integers, got {array.dtype} values")
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a flat list of integers, got shape {list(array.shape)}")
    if array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
        raise ValueError(f"{name}: values must fit INT32 [{_INT32_MIN}, {_INT32_MAX}]")
    return _tensor_input(name, array.astype(np.int32))


def _uint64(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if not 0 <= int(value) <= _UINT64_MAX:
        raise ValueError(f"{name}: must fit UINT64 [0, 2**64 - 1], got {value}")
    return int(value)


def _scalar_input(name: str, value: np.generic) -> InferInput:
    return _tensor_input(name, np.array([value], dtype=value.dtype))


def _tensor_input(name: str, array: np.ndarray) -> InferInput:
    infer_input = InferInput(name, list(array.shape), INPUT_DATATYPES[name])
    infer_input.set_data_from_numpy(array)
    return infer_input


@dataclass(frozen=True)
class Chunk:
    """One streamed response of a request.

    Attributes:
        text: the text of this chunk. A UTF-8 character split across chunks
            appears whole in the later chunk.
        token_ids: token ids of this chunk (may be empty).
        path: the served path (`exact`, `gated`, `prepaid`, `prefix`,
            `rebuild`, `append`, `close`), or None if the response has none.
        confidence: gate score of the first token; None where not applicable.
        finish_reason: `stop`, `length`, `appended` or `closed` on the last
            chunk of a request; None on the others.
        final: this is the last response of its request.
        queue_ms, compute_ms, first_token_ms: server-side timings (arrival to
            pickup by the engine loop; engine time so far; arrival to first
            response), None when absent.
        elapsed_ms: client-measured time from sending the request to
            receiving this response.
        prefill_ms, decode_ms, scan_ms: server-side engine time of this
            request so far in prefill, decode and vocabulary scans; None when
            absent.
    """

    text: str
    token_ids: tuple[int, ...]
    path: str | None
    confidence: float | None
    finish_reason: str | None
    final: bool
    queue_ms: float | None
    compute_ms: float | None
    first_token_ms: float | None
    elapsed_ms: float
    prefill_ms: float | None = None
    decode_ms: float | None = None
    scan_ms: float | None = None


@dataclass(frozen=True)
class Answer:
    """The collected result of a generate request.

    Attributes:
        text, token_ids: the whole answer.
        path, confidence: as reported with the first token.
        finish_reason: why generation stopped (`stop` or `length`).
        queue_ms, first_token_ms: server-side, from the first response.
        compute_ms: server-side engine time, from the last response.
        ttft_ms, total_ms: client-measured, from sending the request to the
            first and to the last response.
        num_chunks: how many responses the answer arrived in.
        prefill_ms, decode_ms, scan_ms: server-side engine time up to the
            first token (from the first response), None when absent.
    """

    text: str
    token_ids: tuple[int, ...]
    path: str | None
    confidence: float | None
    finish_reason: str | None
    queue_ms: float | None
    compute_ms: float | None
    first_token_ms: float | None
    ttft_ms: float
    total_ms: float
    num_chunks: int
    prefill_ms: float | None = None
    decode_ms: float | None = None
    scan_ms: float | None = None

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Answer:
        """Combine the chunks of one request, in arrival order (at least one)."""
        if not chunks:
            raise ValueError("an answer needs at least one chunk")
        return cls(
            text="".join(chunk.text for chunk in chunks),
            token_ids=tuple(token_id for chunk in chunks for token_id in chunk.token_ids),
            path=_first(chunk.path for chunk in chunks),
            confidence=_first(chunk.confidence for chunk in chunks),
            finish_reason=_first(chunk.finish_reason for chunk in reversed(chunks)),
            queue_ms=_first(chunk.queue_ms for chunk in chunks),
            compute_ms=_first(chunk.compute_ms for chunk in reversed(chunks)),
            first_token_ms=_first(chunk.first_token_ms for chunk in chunks),
            ttft_ms=chunks[0].elapsed_ms,
            total_ms=chunks[-1].elapsed_ms,
            num_chunks=len(chunks),
            prefill_ms=chunks[0].prefill_ms,
            decode_ms=chunks[0].decode_ms,
            scan_ms=chunks[0].scan_ms,
        )

    def to_dict(self) -> dict:
        """Plain JSON-serializable form (token_ids as a list)."""
        data = asdict(self)
        data["token_ids"] = list(self.token_ids)
        return data


@dataclass(frozen=True)
class Update:
    """The acknowledgement of an append (max_tokens=0) or a close (END).

    Attributes:
        path: `append` or `close`.
        finish_reason: `appended` or `closed`.
        queue_ms, compute_ms: server-side timings, None when absent.
        total_ms: client-measured, from sending the request to its last response.
    """

    path: str | None
    finish_reason: str | None
    queue_ms: float | None
    compute_ms: float | None
    total_ms: float

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Update:
        """Combine the responses of one append or close request (at least one)."""
        if not chunks:
            raise ValueError("an update needs at least one response")
        return cls(
            path=_first(chunk.path for chunk in chunks),
            finish_reason=_first(chunk.finish_reason for chunk in reversed(chunks)),
            queue_ms=_first(chunk.queue_ms for chunk in chunks),
            compute_ms=_first(chunk.compute_ms for chunk in reversed(chunks)),
            total_ms=chunks[-1].elapsed_ms,
        )

    def to_dict(self) -> dict:
        """Plain JSON-serializable form."""
        return asdict(self)


def _first(values: Iterable):
    return next((value for value in values if value is not None), None)


def new_text_decoder() -> codecs.IncrementalDecoder:
    """A decoder for one request's `text_output` stream (invalid bytes become U+FFFD)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def is_final_response(result: InferResult) -> bool:
    """Whether `result` is the last response of its request.

    True when Triton marked it COMPLETE_FINAL, or when it carries a
    finish_reason (the server sends one only on a request's last response).
    """
    parameters = result.get_response().parameters
    if FINAL_RESPONSE_PARAMETER in parameters and parameters[FINAL_RESPONSE_PARAMETER].bool_param:
        return True
    return _read_str(result, "finish_reason") is not None


def parse_chunk(
    result: InferResult,
    *,
    elapsed_ms: float,
    decoder: codecs.IncrementalDecoder | None = None,
) -> Chunk:
    """Convert one streamed response into a `Chunk`.

    Missing outputs read as empty text, no token ids and None. Pass the same
    `decoder` for every response of a request so that characters split
    across responses decode whole.
    """
    decoder = decoder or new_text_decoder()
    final = is_final_response(result)
    raw_text = _read_bytes(result, "text_output")
    output_ids = result.as_numpy("output_ids")
    return Chunk(
        text=decoder.decode(raw_text or b"", final=final),
        token_ids=tuple(int(token_id) for token_id in output_ids.reshape(-1)) if output_ids is not None else (),
        path=_read_str(result, "path"),
        confidence=_read_float(result, "confidence"),
        finish_reason=_read_str(result, "finish_reason"),
        final=final,
        queue_ms=_read_float(result, "queue_ms"),
        compute_ms=_read_float(result, "compute_ms"),
        first_token_ms=_read_float(result, "first_token_ms"),
        elapsed_ms=elapsed_ms,
        prefill_ms=_read_float(result, "prefill_ms"),
        decode_ms=_read_float(result, "decode_ms"),
        scan_ms=_read_float(result, "scan_ms"),
    )


def _read_bytes(result: InferResult, name: str) -> bytes | None:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _read_str(result: InferResult, name: str) -> str | None:
    raw = _read_bytes(result, name)
    return raw.decode("utf-8", errors="replace") if raw else None


def _read_float(result: InferResult, name: str) -> float | None:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = float(array.reshape(-1)[0])
    return None if math.isnan(value) else value
