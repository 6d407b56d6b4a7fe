"""Session workloads: what a session sends, turn by turn, with think time in between.

A workload is a list of :class:`SessionTrace`; each step is one request
(an update when ``max_tokens`` is 0). The same traces drive the benchmark and
the load test.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
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


def _bfcl_data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or spec.origin is None:
        raise RuntimeError("the bfcl-eval package is not installed (make venv installs it)")
    return Path(spec.origin).parent / "data"


def _tool_line(doc: dict) -> str:
    description = doc["description"].split("Tool description:")[-1].strip()
    first_sentence = re.split(r"(?<=\.)\s", description, maxsplit=1)[0]
    return f"- {doc['name']}: {first_sentence}"


def bfcl_sessions(num_sessions: int, *, think_time_s: float = 2.0, max_turns: int = 4, seed: int = 0) -> list[SessionTrace]:
    """BFCL v4 multi-turn base sessions as tool-routing sessions.

    System turn: the involved classes' tool list. Each user turn is a delta whose
    decision is the name of the next tool to call (``choices`` = the tool names;
    ``expected`` = the first call of the ground truth). After the answer, the
    ground-truth calls come back as a ``tool`` update, as an executed call's
    result would.
    """
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
            steps.append(Step(think_time_s, "user", user, 1, names, expected if expected in names else None))
            steps.append(Step(0.0, "tool", "Executed: " + "; ".join(truth), 0))
        sessions.append(SessionTrace(entry["id"], tuple(steps)))
    return sessions


def monitor_sessions(num_sessions: int, *, num_updates: int = 12, queries_per_update: float = 0.5,
                     think_time_s: float = 1.0, seed: int = 0) -> list[SessionTrace]:
    """A streaming monitor: sensor readings arrive as updates; a registered yes/no question is asked as an empty-delta query."""
    rng = random.Random(seed)
    sessions = []
    for index in range(num_sessions):
        limit = rng.choice([25, 30, 35])
        system = (f"You watch a temperature sensor. Readings arrive one per message. When asked, answer yes if the "
                  f"latest reading is above {limit} degrees, otherwise no.")
        steps, credit = [Step(0.0, "system", system, 0)], 0.0
        value = rng.uniform(15, 40)
        for update in range(num_updates):
            value = min(45.0, max(5.0, value + rng.gauss(0, 3)))
            steps.append(Step(think_time_s, "user", f"Reading {update + 1}: {value:.1f} degrees.", 0))
            credit += queries_per_update
            while credit >= 1.0:
                credit -= 1.0
                steps.append(Step(think_time_s, "user", "", 1, ("yes", "no"), "yes" if value > limit else "no"))
        sessions.append(SessionTrace(f"monitor_{index}", tuple(steps)))
    return sessions
