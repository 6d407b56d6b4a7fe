"""The records file of a calibration replay: one :class:`DecisionRecord` per decision point, keyed by (session,
turn), after a header line that names the placeholders it was written with; reading it back, checking a replay
can go on in it, and the lock one replay at a time holds on it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, Sequence

log = logging.getLogger("prepos.calibration")

RECORDS_FORMAT = 1
EMPTY = "empty"  # the variant name of the empty speculative delta

class StepLike(Protocol):
    role: str
    delta: str
    max_tokens: int
    choices: tuple[str, ...] | None


class SessionLike(Protocol):
    name: str
    steps: Sequence[StepLike]


def steps_digest(steps: Sequence[StepLike], index: int) -> str:
    """A digest of a session's steps up to ``index`` (role, delta, max_tokens and choices of each): what a decision
    point's record was replayed from, so that a rerun on another trace under the same session names is told."""
    key = [[step.role, step.delta, step.max_tokens, None if step.choices is None else list(step.choices)]
           for step in steps[:index + 1]]
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()[:16]



@dataclass(frozen=True)
class SpeculativeFeatures:
    """The scan of one speculative distribution and whether its first decision token agreed with the full path."""

    token_id: int
    p_max: float
    margin: float
    entropy: float
    certainty: float
    num_allowed: int
    agreed: bool


@dataclass(frozen=True)
class DecisionRecord:
    """One decision point: its key, the full path's answer and each speculative variant's features."""

    session: str
    turn: int  # index of the step in its session
    num_delta_tokens: int
    num_choices: int  # 0 for free generation
    full_token_id: int  # the full path's first decision token
    answer_ids: tuple[int, ...]  # the full path's whole answer (what the log grew by, before closing tokens)
    variants: dict[str, SpeculativeFeatures]
    steps_digest: str = ""  # of the session's steps up to this one (steps_digest); "" in files written before it

    def to_json(self) -> str:
        data = asdict(self)
        data["answer_ids"] = list(self.answer_ids)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "DecisionRecord":
        """The record a line holds. For a line that holds none: ValueError naming a value out of its type or
        range (a count below 0, a probability outside [0, 1]), KeyError or TypeError for a field missing or
        unknown, or JSON that is not a record's shape."""
        data = json.loads(line)
        if not isinstance(data, dict) or not isinstance(data.get("variants"), dict) or not data["variants"]:
            raise TypeError("not a record")
        data["answer_ids"] = tuple(data["answer_ids"])
        data["variants"] = {k: SpeculativeFeatures(**v) for k, v in data["variants"].items()}
        record = cls(**data)
        _check_record(record)
        return record


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_share(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0 + 1e-9


def _check_record(record: DecisionRecord) -> None:
    """Raise ValueError naming the first field of ``record`` of the wrong type or outside its range (a record
    edited by hand, or not written by a replay): the report would fail on it with a traceback, or count it."""
    checks = [("session", isinstance(record.session, str) and record.session != ""),
              ("turn", _is_count(record.turn)), ("num_delta_tokens", _is_count(record.num_delta_tokens)),
              ("num_choices", _is_count(record.num_choices)), ("full_token_id", _is_count(record.full_token_id)),
              ("answer_ids", all(_is_count(token) for token in record.answer_ids)),
              ("steps_digest", isinstance(record.steps_digest, str))]
    for name, features in record.variants.items():
        checks += [(f"variants.{name}.{field}", ok) for field, ok in (
            ("token_id", _is_count(features.token_id)), ("num_allowed", _is_count(features.num_allowed)),
            ("p_max", _is_share(features.p_max)), ("margin", _is_share(features.margin)),
            ("certainty", _is_share(features.certainty)),
            ("entropy", isinstance(features.entropy, (int, float)) and not isinstance(features.entropy, bool)
             and math.isfinite(features.entropy) and features.entropy >= 0),
            ("agreed", isinstance(features.agreed, bool)))]
    for name, ok in checks:
        if not ok:
            raise ValueError(f"{name}: not a value a replay writes")


def _decision(record: DecisionRecord) -> tuple:
    """What a record says of its decision point, without the scores' last bits: a point replayed twice (two runs
    on one file, each with its own prefix reuse) may differ there, on a GPU, and is the same point."""
    return (record.steps_digest, record.full_token_id, record.answer_ids,
            sorted((name, f.token_id, f.agreed, f.num_allowed) for name, f in record.variants.items()))


def records_header(placeholders: dict[str, str]) -> dict:
    """The header line's content of a records file written with ``placeholders``."""
    return {"format": RECORDS_FORMAT, "placeholders": dict(placeholders)}


def read_records(path: str | Path) -> tuple[dict, list[DecisionRecord]]:
    """The header and the records of a records file (empty when the file does not exist).

    A truncated last line (an interrupted write: the start of a record that is not JSON, with no newline after it)
    is ignored. A record found again under its key (session, turn) with the same outcome counts once (two runs on
    one file, before :meth:`~prepos.calibration.CalibrationReplay.run` locked it). Raises ValueError naming the
    line of anything else: a line that is not a record (a field missing, of the wrong type or out of range), a
    record before any header line, a record of another outcome than the first under its key, or one whose
    speculative deltas are not the file's.
    """
    path = Path(path)
    if not path.is_file():
        return {}, []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a calibration records file (not UTF-8 text)") from None
    lines = text.split("\n")
    header, records, by_key, num_repeated = {}, [], {}, 0
    variants = None
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            if number == 0 and '"header"' in line:
                header = json.loads(line)["header"]
                if not isinstance(header, dict) or not isinstance(header.get("placeholders"), dict):
                    raise ValueError("not a header")
                variants = {EMPTY, *header["placeholders"]}
                continue
            record = DecisionRecord.from_json(line)
        except (ValueError, KeyError, TypeError) as error:  # json.JSONDecodeError is a ValueError
            # cut short by an interrupted write: the start of a record, not JSON, and no newline after it
            if number == len(lines) - 1 and isinstance(error, json.JSONDecodeError) and line.startswith("{"):
                log.warning("%s: ignoring a truncated last line", path)
                continue
            # a value out of its type or range is named (ValueError); a line of another shape is not a record
            said = f" ({error})" if isinstance(error, ValueError) and not isinstance(error, json.JSONDecodeError) \
                else ""
            raise ValueError(f"{path}:{number + 1}: not a calibration record{said}") from None
        if not header:  # every records file starts with one: this one was not written by a replay
            raise ValueError(f"{path}:{number + 1}: not a calibration records file (no header line before it)")
        if set(record.variants) != variants:
            raise ValueError(f"{path}:{number + 1}: the record holds the speculative deltas "
                             f"{', '.join(sorted(record.variants))}, not the file's {', '.join(sorted(variants))}")
        key = (record.session, record.turn)
        if key in by_key:
            if _decision(by_key[key]) != _decision(record):
                raise ValueError(f"{path}:{number + 1}: session {record.session!r} turn {record.turn} is recorded "
                                 f"again, with another outcome than at its first record (records of two traces, or "
                                 f"of two engines, in one file); remove line {number + 1}, or record into another "
                                 "--out")
            num_repeated += 1
            continue
        by_key[key] = record
        records.append(record)
    if num_repeated:
        log.warning("%s: %d records repeated under their session and turn counted once", path, num_repeated)
    return header, records


def end_last_line(path: Path) -> None:
    """End the last line of ``path`` before records are appended: a line cut short (a write interrupted by a
    kill), which :func:`read_records` passes over, is removed; a whole record without its newline, which it
    counts, gets one. Either way, appended to, it would run into the next record and make the file unreadable."""
    try:
        with path.open("rb+") as file:
            data = file.read()
            if not data or data.endswith(b"\n"):
                return
            start = data.rfind(b"\n") + 1
            try:
                json.loads(data[start:])
            except ValueError:
                file.truncate(start)
            else:
                file.write(b"\n")
    except FileNotFoundError:
        return


def _check_recorded_from_the_same_steps(sessions: Sequence[SessionLike], done: dict, records_path: Path) -> None:
    """Raise ValueError when a decision point already recorded under a session name and turn was replayed from
    other steps than the session of that name has now (another trace, or another workload seed, on the same
    records): it would be skipped as recorded, and the report would cover the other trace's points."""
    for session in sessions:
        for index in range(len(session.steps)):
            record = done.get((session.name, index))
            if record is not None and record.steps_digest and record.steps_digest != steps_digest(session.steps,
                                                                                                   index):
                raise ValueError(f"records: {records_path} holds session {session.name!r} turn {index} replayed "
                                 "from other steps (another trace, or another seed); use another --out (or "
                                 "--records), or the trace and seed it was recorded from")


def check_resumable(records_path: str | Path, sessions: Sequence[SessionLike],
                    placeholders: dict[str, str]) -> dict:
    """The records of the records file by (session, turn), once it is known that a replay of ``sessions`` with
    ``placeholders`` can go on in it (what `prepos calibrate` checks before the model loads). Raises ValueError
    when the file is not a records file (:func:`read_records`), was written with other placeholders, or holds a
    decision point of one of ``sessions`` replayed from other steps."""
    records_path = Path(records_path)
    header, existing = read_records(records_path)
    if header and header != records_header(placeholders):
        raise ValueError(f"records: {records_path} was written with {header}, not {records_header(placeholders)}; "
                         "use another file or the same placeholders")
    done = {(r.session, r.turn): r for r in existing}
    _check_recorded_from_the_same_steps(sessions, done, records_path)
    return done


def check_not_in_use(records_path: str | Path) -> None:
    """Raise ValueError when a replay is writing to ``records_path`` now (what `prepos calibrate` checks before
    the model loads; :meth:`CalibrationReplay.run` holds the lock itself)."""
    try:
        with Path(records_path).open("rb") as file:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except FileNotFoundError:
        return
    except BlockingIOError:
        raise ValueError(_IN_USE.format(path=records_path)) from None


_IN_USE = "records: another prepos calibrate run is writing to {path}; wait for it to end, or use another --out " \
          "(or --records)"


@contextlib.contextmanager
def locked_for_appending(path: Path):
    """``path`` opened for appending, with an exclusive lock on it for as long as it is open: two runs appending
    to one records file would each record the points the other does, and the report would count them twice."""
    with path.open("a", encoding="utf-8") as out:
        try:
            fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(_IN_USE.format(path=path)) from None
        yield out
