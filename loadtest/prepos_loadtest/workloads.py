"""Session workloads: what a session sends, turn by turn, with think time in between.

A workload is a list of :class:`SessionTrace`; each step is one request
(an update when ``max_tokens`` is 0). The same traces drive the benchmark and
the load test. Built-in workloads are registered by name in ``WORKLOADS``;
any workload can be written to and read back from a JSONL trace file
(``write_trace`` / ``read_trace``), one JSON object per step.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

BFCL_CLASS_FILES = {
    "GorillaFileSystem": "gorilla_file_system.json",
    "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json",
    "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json",
    "VehicleControlAPI": "vehicle_control.json",
}


@dataclass(frozen=True)
class Step:
    delay_s: float  # think time before this request
    role: str
    delta: str
    max_tokens: int
    choices: tuple[str, ...] | None = None
    expected: str | None = None  # the reference answer, where the workload knows it


@dataclass(frozen=True)
class SessionTrace:
    name: str
    steps: tuple[Step, ...]


@dataclass(frozen=True)
class ThinkTime:
    """The think time before a request: lognormal with median `median_s` and shape `sigma`.

    `sigma` 0 means always exactly `median_s`. Samples are drawn from the RNG
    the caller passes, so a seeded RNG gives the same delays on every run.
    """

    median_s: float
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median_s) and self.median_s >= 0):
            raise ValueError(f"median_s: must be a finite number >= 0, got {self.median_s}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma: must be a finite number >= 0 (0 = constant), got {self.sigma}")

    def sample(self, rng: random.Random) -> float:
        """One think time in seconds (>= 0); consumes randomness only when `sigma` > 0 and `median_s` > 0."""
        if self.sigma == 0 or self.median_s == 0:
            return self.median_s
        return rng.lognormvariate(math.log(self.median_s), self.sigma)


def _think_rng(seed: int) -> random.Random:
    # Separate from the content RNG: changing the think-time distribution
    # never changes which sessions or messages a workload holds.
    return random.Random(f"think-time:{seed}")


def _bfcl_data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        raise RuntimeError("the bfcl-eval package is not installed (make venv installs it)")
    return Path(spec.origin).parent / "data"


def _tool_line(doc: dict) -> str:
    description = doc["description"].split("Tool description:")[-1].strip()
    first_sentence = re.split(r"(?<=\.)\s", description, maxsplit=1)[0]
    return f"- {doc['name']}: {first_sentence}"


def bfcl_sessions(num_sessions: int, *, think_time_s: float = 2.0, max_turns: int = 4, seed: int = 0,
                  think_time: ThinkTime | None = None) -> list[SessionTrace]:
    """BFCL v4 multi-turn base sessions as tool-routing sessions.

    System turn: the involved classes' tool list. Each user turn is a delta whose
    decision is the name of the next tool to call (``choices`` = the tool names;
    ``expected`` = the first call of the ground truth). After the answer, the
    ground-truth calls come back as a ``tool`` update, as an executed call's
    result would. The think time before each user turn is `think_time_s`, or a
    sample of `think_time` when given; updates follow their answer at once.
    """
    think = think_time if think_time is not None else ThinkTime(think_time_s)
    think_rng = _think_rng(seed)
    data = _bfcl_data_dir()
    entries = [json.loads(line) for line in (data / "BFCL_v4_multi_turn_base.json").read_text().splitlines()]
    answers = {
        (a := json.loads(line))["id"]: a["ground_truth"]
        for line in (data / "possible_answer" / "BFCL_v4_multi_turn_base.json").read_text().splitlines()
    }
    rng = random.Random(seed)
    picked = rng.sample(entries, min(num_sessions, len(entries)))
    sessions = []
    for entry in picked:
        docs = []
        for cls in entry["involved_classes"]:
            path = data / "multi_turn_func_doc" / BFCL_CLASS_FILES[cls]
            docs += [json.loads(line) for line in path.read_text().splitlines()]
        names = tuple(dict.fromkeys(d["name"] for d in docs))
        system = ("You are an agent that operates tools. Reply with only the name of the next tool to call.\n"
                  "Tools:\n" + "\n".join(_tool_line(d) for d in docs))
        steps = [Step(0.0, "system", system, 0)]
        for turn, (messages, truth) in enumerate(zip(entry["question"], answers[entry["id"]])):
            if turn >= max_turns or not truth:
                break
            user = " ".join(m["content"] for m in messages if m["role"] == "user")
            expected = truth[0].split("(", 1)[0]
            steps.append(Step(think.sample(think_rng), "user", user, 1, names, expected if expected in names else None))
            steps.append(Step(0.0, "tool", "Executed: " + "; ".join(truth), 0))
        sessions.append(SessionTrace(entry["id"], tuple(steps)))
    return sessions


def monitor_sessions(num_sessions: int, *, num_updates: int = 12, queries_per_update: float = 0.5,
                     think_time_s: float = 1.0, seed: int = 0,
                     think_time: ThinkTime | None = None) -> list[SessionTrace]:
    """A streaming monitor: sensor readings arrive as updates; a registered yes/no question is asked as an empty-delta query.

    Every reading and query waits `think_time_s` (or a sample of `think_time` when given) before it is sent.
    """
    rng = random.Random(seed)
    think = think_time if think_time is not None else ThinkTime(think_time_s)
    think_rng = _think_rng(seed)
    sessions = []
    for index in range(num_sessions):
        limit = rng.choice([25, 30, 35])
        system = (f"You watch a temperature sensor. Readings arrive one per message. When asked, answer yes if the "
                  f"latest reading is above {limit} degrees, otherwise no.")
        steps, credit = [Step(0.0, "system", system, 0)], 0.0
        value = rng.uniform(15, 40)
        for update in range(num_updates):
            value = min(45.0, max(5.0, value + rng.gauss(0, 3)))
            steps.append(Step(think.sample(think_rng), "user", f"Reading {update + 1}: {value:.1f} degrees.", 0))
            credit += queries_per_update
            while credit >= 1.0:
                credit -= 1.0
                steps.append(Step(think.sample(think_rng), "user", "", 1, ("yes", "no"),
                                  "yes" if value > limit else "no"))
        sessions.append(SessionTrace(f"monitor_{index}", tuple(steps)))
    return sessions


CHAT_SYSTEM = "You are a helpful assistant. Keep every answer short."
CHAT_TOPICS = (
    "photosynthesis", "how bicycle gears work", "the water cycle", "compound interest", "why the sky is blue",
    "how vaccines work", "the rules of chess", "what a hash table is", "how to brew green tea", "plate tectonics",
    "the French Revolution", "how a rainbow forms", "binary numbers", "how bees make honey", "inflation",
    "how a compass works", "black holes", "how bread rises", "the immune system", "how a refrigerator works",
)
CHAT_OPENERS = (
    "Explain {topic} in two sentences.",
    "What should a beginner know about {topic}?",
    "Give me a short summary of {topic}.",
    "I keep hearing about {topic}. What is it?",
)
CHAT_FOLLOW_UPS = (
    "Can you give a concrete example?",
    "Explain that more simply.",
    "What is a common misconception about it?",
    "Why does that matter in everyday life?",
    "Summarize that in one sentence.",
    "What should I read next to learn more?",
    "How would you explain it to a child?",
    "What is the most surprising fact about it?",
)


def chat_sessions(num_sessions: int, *, num_turns: int = 4, max_tokens: int = 32,
                  think_time: ThinkTime = ThinkTime(median_s=4.0, sigma=0.6), seed: int = 0) -> list[SessionTrace]:
    """Multi-turn chat: free generation, one user message per turn, a human's think time in between.

    Each session appends a system message, then asks `num_turns` questions on
    one topic (an opener, then follow-ups that refer back to the answers), each
    answered with up to `max_tokens` tokens. The think time before each
    question is a sample of `think_time` (reading the answer, typing the next
    message).
    """
    if num_turns < 1:
        raise ValueError(f"num_turns: must be >= 1, got {num_turns}")
    rng = random.Random(seed)
    think_rng = _think_rng(seed)
    sessions = []
    for index in range(num_sessions):
        topic = rng.choice(CHAT_TOPICS)
        questions = [rng.choice(CHAT_OPENERS).format(topic=topic)]
        questions += rng.sample(CHAT_FOLLOW_UPS, min(num_turns - 1, len(CHAT_FOLLOW_UPS)))
        steps = [Step(0.0, "system", CHAT_SYSTEM, 0)]
        steps += [Step(think_time.sample(think_rng), "user", question, max_tokens) for question in questions]
        sessions.append(SessionTrace(f"chat_{index}", tuple(steps)))
    return sessions


# Name -> builder(num_sessions, *, seed, think_time). A builder given
# think_time=None uses the workload's own think-time default.
WORKLOADS: dict[str, Callable[..., list[SessionTrace]]] = {
    "bfcl": bfcl_sessions,
    "monitor": monitor_sessions,
    "chat": chat_sessions,
}


def build_workload(name: str, num_sessions: int, *, seed: int = 0,
                   think_time: ThinkTime | None = None) -> list[SessionTrace]:
    """The built-in workload `name` (a key of ``WORKLOADS``) with `num_sessions` sessions.

    Raises:
        ValueError: `name` is not a registered workload.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    options = {"seed": seed} if think_time is None else {"seed": seed, "think_time": think_time}
    return WORKLOADS[name](num_sessions, **options)


# --- JSONL trace files ---------------------------------------------------------

TRACE_FIELDS = ("session", "delay_s", "role", "delta", "max_tokens", "choices", "expected")
_REQUIRED_TRACE_FIELDS = ("session", "delta", "max_tokens")


class TraceFormatError(ValueError):
    """A trace file line that is not a valid step; the message names the file, line and field."""


def step_record(session: str, step: Step) -> dict:
    """The JSON object of one step in a trace file (``expected`` only when known)."""
    record = {
        "session": session,
        "delay_s": step.delay_s,
        "role": step.role,
        "delta": step.delta,
        "max_tokens": step.max_tokens,
        "choices": None if step.choices is None else list(step.choices),
    }
    if step.expected is not None:
        record["expected"] = step.expected
    return record


def write_trace(path: str | Path, traces: Iterable[SessionTrace]) -> int:
    """Write `traces` to `path` as JSONL, one step per line, each session's steps in order.

    Returns the number of lines written.

    Raises:
        ValueError: two traces share a name (they would read back as one session).
    """
    lines, seen = [], set()
    for trace in traces:
        if trace.name in seen:
            raise ValueError(f"session: two traces are named {trace.name!r}; trace names must be unique")
        seen.add(trace.name)
        lines += [json.dumps(step_record(trace.name, step), ensure_ascii=False) for step in trace.steps]
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)


def read_trace(path: str | Path) -> list[SessionTrace]:
    """Read a JSONL trace file into sessions.

    Each non-blank line is one step: ``session`` (str), ``delta`` (str) and
    ``max_tokens`` (int; 0 = an update) are required; ``delay_s`` (seconds of
    think time before the step, >= 0, default 0), ``role`` (default
    ``user``), ``choices`` (list of str or null) and ``expected`` (str or
    null) are optional. Steps of one session may be interleaved with other
    sessions' steps; each session keeps its steps in file order, and sessions
    come in the order they first appear. Values are checked for type only (and
    ``max_tokens`` for the INT32 the server's input is): whether the server
    accepts them (a negative ``max_tokens``, say) is the server's to decide.

    Raises:
        TraceFormatError: a line is not UTF-8 text or not a JSON object, a
            field is missing, unknown or of the wrong type, or an update
            carries choices (the message names file, line, field); or the file
            has no step at all.
    """
    path = Path(path)
    sessions: dict[str, list[Step]] = {}
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise TraceFormatError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at "
                                       f"byte {error.start} of the line)") from None
            if line.strip():
                session, step = _parse_step(line, f"{path}:{number}")
                sessions.setdefault(session, []).append(step)
    if not sessions:
        raise TraceFormatError(f"{path}: no step: the file is empty or blank")
    return [SessionTrace(name, tuple(steps)) for name, steps in sessions.items()]


def _parse_step(line: str, where: str) -> tuple[str, Step]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        # the decoder's own "line 2 column 1" counts the line breaks JSON allows inside a value, not the file's
        raise TraceFormatError(f"{where}: not valid JSON: {error.msg} at character {error.pos + 1} of the line") \
            from None
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    unknown = sorted(set(record) - set(TRACE_FIELDS))
    if unknown:
        raise TraceFormatError(f"{where}: {unknown[0]}: unknown field; fields are {', '.join(TRACE_FIELDS)}")
    for name in _REQUIRED_TRACE_FIELDS:
        if name not in record:
            raise TraceFormatError(f"{where}: {name}: missing")

    def check(name: str, ok: bool, expected: str) -> None:
        if not ok:
            raise TraceFormatError(f"{where}: {name}: expected {expected}, got {record[name]!r}")

    session, delta, max_tokens = record["session"], record["delta"], record["max_tokens"]
    delay_s, role = record.get("delay_s", 0.0), record.get("role", "user")
    choices, expected = record.get("choices"), record.get("expected")
    check("session", isinstance(session, str) and session != "", "a non-empty string")
    check("delta", isinstance(delta, str), "a string")
    check("max_tokens", isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
          and -2**31 <= max_tokens < 2**31, "an integer (INT32, as the server's input)")
    if "delay_s" in record:
        check("delay_s", isinstance(delay_s, (int, float)) and not isinstance(delay_s, bool)
              and math.isfinite(delay_s) and delay_s >= 0, "a number of seconds >= 0")
    if "role" in record:
        check("role", isinstance(role, str), "a string")
    if choices is not None:
        check("choices", isinstance(choices, list) and all(isinstance(c, str) for c in choices),
              "a list of strings or null")
        check("choices", max_tokens != 0, "null on an update (max_tokens 0), which asks for no answer")
    if expected is not None:
        check("expected", isinstance(expected, str), "a string or null")
    step = Step(float(delay_s), role, delta, max_tokens, None if choices is None else tuple(choices), expected)
    return session, step
