"""Calibration replay on the fake engine, resumability, and the report (prepos.calibration*)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from fakes import FakeEngine, chatml_framing, char_tokenizer, hashed_logits
from prepos.calibration import EMPTY, CalibrationReplay, DecisionRecord, SpeculativeFeatures, read_records
from prepos.calibration_report import calibrate, config_fragment, split_sessions, write_report
from prepos.config import read_config
from prepos.scan import scan_numpy


@dataclass(frozen=True)
class Step:
    role: str
    delta: str
    max_tokens: int
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Session:
    name: str
    steps: tuple[Step, ...]


YES_NO = ("yes", "no")
SESSIONS = [
    Session("a", (Step("system", "Say yes or no.", 0), Step("user", "Is it?", 1, YES_NO), Step("tool", "ok", 0),
                  Step("user", "", 1, YES_NO), Step("user", "And now?", 1, YES_NO))),
    Session("b", (Step("user", "Pick one", 1, ("alpha", "alps", "beta")), Step("user", "hi", 3))),
    Session("c", (Step("user", "Which way?", 1, ("go left", "go right")),)),
]


@pytest.fixture
def parts(tmp_path):
    tok = char_tokenizer(tmp_path)
    return tok, chatml_framing(tok)


def make_replay(parts, engine=None, placeholders=None):
    tok, framing = parts
    engine = engine or FakeEngine()
    return engine, CalibrationReplay(engine, tok, framing, placeholders=placeholders or {"dots": "..."})


def test_records_each_decision_point_with_the_full_paths_agreement(parts, tmp_path):
    tok, framing = parts
    engine, replay = make_replay(parts)
    summary = replay.run(SESSIONS, tmp_path / "r.jsonl")
    header, records = read_records(tmp_path / "r.jsonl")
    assert header == {"format": 1, "placeholders": {"dots": "..."}}
    # Updates and the empty-delta generate step are not decision points.
    assert [(r.session, r.turn) for r in records] == [("a", 1), ("a", 4), ("b", 0), ("b", 1), ("c", 0)]
    assert summary.num_recorded == 5 and summary.num_skipped == 0
    assert engine.kv == {}  # every engine session released

    # Independent check of the first decision point: build both sequences by hand and scan them.
    enc = tok.encode
    log = [*framing.entry_ids["system"], *enc("Say yes or no."), *framing.close_ids]
    allowed = sorted({enc("yes")[0], enc("no")[0]})
    full = scan_numpy(hashed_logits([*log, *framing.entry_ids["user"], *enc("Is it?"), *framing.cue_ids], 98),
                      allowed_ids=allowed)
    spec = scan_numpy(hashed_logits([*log, *framing.entry_ids["user"], *framing.cue_ids], 98), allowed_ids=allowed)
    first = records[0]
    assert first.full_token_id == full.token_id and first.num_choices == 2
    assert first.variants[EMPTY].token_id == spec.token_id
    assert first.variants[EMPTY].p_max == pytest.approx(spec.p_max)
    assert first.variants[EMPTY].agreed == (spec.token_id == full.token_id)
    assert set(first.variants) == {EMPTY, "dots"}

    b0 = records[2]
    assert b0.num_choices == 3 and tok.decode(b0.answer_ids) in ("alpha", "alps", "beta")
    # Free generation: the first token is the decision, the answer stops at the stop token or max_tokens.
    b1 = records[3]
    assert b1.num_choices == 0 and 1 <= len(b1.answer_ids) <= 3 and b1.full_token_id == b1.answer_ids[0]
    # Choices sharing leading tokens: those are forced, the decision is the first token after them.
    c0 = records[4]
    assert tok.decode(c0.answer_ids).startswith("go ") and tok.decode([c0.full_token_id]) in ("l", "r")
    assert tok.decode([c0.variants[EMPTY].token_id]) in ("l", "r") and c0.variants[EMPTY].num_allowed == 2


def test_rerun_skips_recorded_points_and_matches_one_full_run(parts, tmp_path):
    once_engine, once = make_replay(parts)
    once.run(SESSIONS, tmp_path / "once.jsonl")
    _, expected = read_records(tmp_path / "once.jsonl")

    _, first = make_replay(parts)
    assert first.run(SESSIONS, tmp_path / "r.jsonl", max_points=2).num_recorded == 2
    engine, second = make_replay(parts)
    summary = second.run(SESSIONS, tmp_path / "r.jsonl")
    assert (summary.num_recorded, summary.num_skipped) == (3, 2)
    # Session "a" was complete: the rerun computed only what sessions "b" and "c" need.
    bc_engine, bc = make_replay(parts)
    bc.run(SESSIONS[1:], tmp_path / "bc.jsonl")
    computed = sum(n for _, _, n in engine.calls)
    assert computed == sum(n for _, _, n in bc_engine.calls) < sum(n for _, _, n in once_engine.calls)
    _, records = read_records(tmp_path / "r.jsonl")
    assert records == expected

    engine, third = make_replay(parts)
    assert third.run(SESSIONS, tmp_path / "r.jsonl").num_recorded == 0 and engine.calls == []


def test_resume_mid_session_rebuilds_the_log_from_recorded_answers(parts, tmp_path):
    _, once = make_replay(parts)
    once.run(SESSIONS[:1], tmp_path / "once.jsonl")
    _, first = make_replay(parts)
    first.run(SESSIONS[:1], tmp_path / "r.jsonl", max_points=1)
    engine, second = make_replay(parts)
    second.run(SESSIONS[:1], tmp_path / "r.jsonl")
    assert read_records(tmp_path / "r.jsonl")[1] == read_records(tmp_path / "once.jsonl")[1]


def test_other_placeholders_and_bad_lines_are_refused(parts, tmp_path):
    _, replay = make_replay(parts)
    replay.run(SESSIONS[:1], tmp_path / "r.jsonl", max_points=1)
    _, other = make_replay(parts, placeholders={"x": "?"})
    with pytest.raises(ValueError, match="placeholders"):
        other.run(SESSIONS, tmp_path / "r.jsonl")
    with pytest.raises(ValueError, match="reserved"):
        make_replay(parts, placeholders={EMPTY: "x"})
    # A truncated last line (an interrupted write) is dropped, then recomputed.
    path = tmp_path / "r.jsonl"
    path.write_text(path.read_text() + '{"answer_ids": [1')
    assert len(read_records(path)[1]) == 1
    _, again = make_replay(parts)
    again.run(SESSIONS[:1], path)  # the cut line goes first: appended to, it ran into the next record
    _, full = make_replay(parts)
    full.run(SESSIONS[:1], tmp_path / "full.jsonl")
    assert read_records(path) == read_records(tmp_path / "full.jsonl")
    # A whole last record that lost only its newline counts as recorded, and stays.
    path.write_text(path.read_text().rstrip("\n"))
    _, after = make_replay(parts)
    assert after.run(SESSIONS[:1], path).num_recorded == 0
    assert read_records(path) == read_records(tmp_path / "full.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_records(bad)


def _record(session: str, turn: int, score: float, agreed: bool) -> DecisionRecord:
    features = SpeculativeFeatures(1, score, score, 0.1, score, 2, agreed)
    return DecisionRecord(session, turn, 5, 2, 1, (1,), {EMPTY: features, "dots": features})


def test_split_is_by_session_and_disjoint():
    records = [_record(f"s{i}", t, 0.9, True) for i in range(200) for t in range(2)]
    cal, held = split_sessions(records, 0.5)
    assert {r.session for r in cal}.isdisjoint({r.session for r in held})
    assert 60 < len({r.session for r in held}) < 140
    assert split_sessions(records, 0.5) == (cal, held)


def test_calibrate_chooses_and_writes_report_and_fragment(tmp_path):
    records = [_record(f"s{i}", 0, 0.999, True) for i in range(600)] + \
              [_record(f"t{i}", 0, 0.6, i % 2 == 0) for i in range(400)]
    open_result, closed_result = calibrate(records, epsilons=[0.05, 0.001], delta=0.1)
    chosen = open_result.chosen
    assert chosen is not None and chosen.variant == EMPTY and chosen.score == "p_max"
    assert 0.6 < chosen.calibration.threshold <= 0.999 and chosen.calibration.num_errors == 0
    assert chosen.held_out.num_errors == 0 and chosen.held_out.num_accepted > 200
    assert closed_result.chosen is None  # 0.001 needs thousands of clean answers

    paths = write_report(tmp_path / "rep", records, [open_result, closed_result], title="synthetic",
                         placeholders={"dots": "..."}, held_out_fraction=0.5)
    names = sorted(p.name for p in paths)
    assert names == ["gate_eps0.001.pbtxt", "gate_eps0.05.pbtxt", "report.md", "risk_coverage.csv",
                     "risk_coverage.png"]
    assert (tmp_path / "rep" / "risk_coverage.png").read_bytes()[:4] == b"\x89PNG"
    assert "Gate off" in (tmp_path / "rep" / "report.md").read_text()
    rows = (tmp_path / "rep" / "risk_coverage.csv").read_text().splitlines()
    assert rows[0].startswith("epsilon,score,variant,threshold") and len(rows) > 1

    def parameters(text: str) -> dict[str, str]:
        return dict(re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', text))

    on = parameters(config_fragment(open_result, {"dots": "..."}))
    config = read_config(on, environ={})
    assert config.gate.speculate and config.gate.threshold == chosen.calibration.threshold
    assert config.gate.epsilon == 0.05 and config.gate.confidence == pytest.approx(0.9)
    assert config.gate.speculative_delta == ""
    off = read_config(parameters(config_fragment(closed_result, {})), environ={})
    assert off.gate.speculate is False


def test_calibrate_needs_calibration_records_and_known_candidates():
    with pytest.raises(ValueError, match="records"):
        calibrate([], epsilons=[0.1], delta=0.1)
    records = [_record(f"s{i}", 0, 0.9, True) for i in range(50)]
    with pytest.raises(ValueError, match="scores"):
        calibrate(records, epsilons=[0.1], delta=0.1, scores=["lead"])
    with pytest.raises(ValueError, match="variants"):
        calibrate(records, epsilons=[0.1], delta=0.1, variants=["other"])


def test_fewer_candidates_fixed_in_advance_certify_at_a_larger_level():
    records = [_record(f"s{i}", 0, 0.999, True) for i in range(400)]
    six = calibrate(records, epsilons=[0.05], delta=0.1)[0]
    one = calibrate(records, epsilons=[0.05], delta=0.1, scores=["p_max"], variants=[EMPTY])[0]
    assert len(six.candidates) == 6 and len(one.candidates) == 1
    assert one.chosen.calibration.bound < six.chosen.calibration.bound
    assert one.chosen.calibration.delta == pytest.approx(0.1) and six.chosen.calibration.delta == pytest.approx(0.1 / 6)


def test_records_round_trip_through_json():
    record = _record("s", 3, 0.7, False)
    assert DecisionRecord.from_json(record.to_json()) == record
    assert json.loads(record.to_json())["variants"][EMPTY]["agreed"] is False


def test_turns_past_the_context_are_not_recorded(parts, tmp_path):
    tok, framing = parts
    replay = CalibrationReplay(FakeEngine(max_context=120), tok, framing)
    long = Session("long", (Step("user", "short?", 1, YES_NO), Step("user", "x" * 200, 1, YES_NO),
                            Step("user", "again?", 1, YES_NO)))
    summary = replay.run([long, SESSIONS[1]], tmp_path / "r.jsonl")
    _, records = read_records(tmp_path / "r.jsonl")
    # Sessions run grouped by their opening turn ("Pick one" sorts before "short?").
    assert [(r.session, r.turn) for r in records] == [("b", 0), ("b", 1), ("long", 0)]
    assert summary.num_recorded == 3


def test_aurc_rewards_ranking_errors_last():
    from prepos.calibration_report import aurc

    # Error ranked last: risks 0, 0, 1/3.
    assert aurc([0.9, 0.8, 0.1], [True, True, False]) == pytest.approx(1 / 9)
    # Error ranked first: risks 1, 1/2, 1/3 over coverage 1/3, 2/3, 1.
    assert aurc([0.9, 0.8, 0.1], [False, True, True]) == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    # Ties are accepted together: one point on the curve, at the tied group's rate.
    assert aurc([0.5, 0.5], [True, False]) == pytest.approx(0.5)
    assert aurc([0.9, 0.5, 0.5], [True, True, False]) == pytest.approx((0 + 2 * (1 / 3)) / 3)


def test_no_decision_point_is_told_apart_from_too_few_sessions(parts):
    """Both said "more sessions needed"; with no step a decision point, more sessions never help."""
    from prepos.calibration import check_replayable

    _, framing = parts
    updates_only = [Session("u", (Step("system", "Watch.", 0), Step("user", "Reading 1.", 0)))]
    empty_queries = [Session("q", (Step("user", "Reading 1.", 0), Step("user", "", 1, YES_NO)))]
    for sessions, why in [(updates_only, "no step asks for an answer"),
                          (empty_queries, "each of the 1 steps that ask for an answer has an empty delta")]:
        with pytest.raises(ValueError, match=rf"^no decision points: {why}") as raised:
            check_replayable(sessions, framing)
        assert "more sessions" not in str(raised.value)
    check_replayable(SESSIONS, framing)
    with pytest.raises(ValueError, match=r"^records: no decision point recorded$"):
        calibrate([], epsilons=[0.1], delta=0.1)
    held_out = [r for r in (_record(f"s{i}", 0, 0.9, True) for i in range(20)) if not split_sessions([r], 0.5)[0]]
    with pytest.raises(ValueError, match=rf"^records: the {len(held_out)} decision points .* all fell in the "
                                         r"held-out part; more sessions needed$"):
        calibrate(held_out, epsilons=[0.1], delta=0.1)


def test_a_variant_not_recorded_is_refused_even_beside_recorded_ones():
    """It was dropped silently, and the report covered fewer candidates than asked for."""
    records = [_record(f"s{i}", 0, 0.9, True) for i in range(50)]
    with pytest.raises(ValueError, match=r"^variants: 'nosuch' not recorded; recorded: empty, dots$"):
        calibrate(records, epsilons=[0.1], delta=0.1, variants=[EMPTY, "nosuch"])
    assert len(calibrate(records, epsilons=[0.1], delta=0.1, variants=["dots"])[0].candidates) == 3


def test_the_reports_agreement_column_says_which_points_it_covers(tmp_path):
    """It was labelled "all points" and computed over the calibration part only."""
    records = [_record(f"s{i}", 0, 0.9, i % 3 != 0) for i in range(120)]
    results = calibrate(records, epsilons=[0.1], delta=0.1, scores=["p_max"], variants=[EMPTY])
    cal, _ = split_sessions(records, 0.5)
    agreement = sum(r.variants[EMPTY].agreed for r in cal) / len(cal)
    assert agreement != pytest.approx(sum(r.variants[EMPTY].agreed for r in records) / len(records), abs=5e-4)
    write_report(tmp_path, records, results, title="t", placeholders={"dots": "..."}, held_out_fraction=0.5)
    header, _, row = [line for line in (tmp_path / "report.md").read_text().splitlines() if line.startswith("|")]
    assert header.split(" | ")[2] == "agreement (calibration part, no threshold)"
    assert row.split(" | ")[2] == f"{agreement:.3f}"


def test_the_fragment_in_place_of_the_shipped_gate_lines_is_a_config_triton_reads(tmp_path):
    """Its lines ended with a comma: pasted as the last entries of parameters [ ... ] they broke the file. Now they
    replace the shipped config's gate lines, which have their form."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from prepos.launch_checks import check_repositories
    from prepos.launcher import REPO_ROOT

    records = [_record(f"s{i}", 0, 0.999, True) for i in range(600)]
    open_result, closed_result = calibrate(records, epsilons=[0.05, 0.001], delta=0.1)
    assert open_result.chosen is not None and closed_result.chosen is None
    shipped = (REPO_ROOT / "model_repository" / "prepos" / "config.pbtxt").read_text().splitlines(keepends=True)
    gate_lines = [i for i, line in enumerate(shipped) if line.startswith('parameters { key: "gate.')]
    assert len(gate_lines) == 2 and gate_lines[1] == gate_lines[0] + 1
    for result in (open_result, closed_result):
        fragment = config_fragment(result, {"dots": "..."})
        text = "".join(shipped[:gate_lines[0]]) + fragment + "".join(shipped[gate_lines[1] + 1:])
        parameters = text_format.Parse(text, model_config_pb2.ModelConfig()).parameters
        assert parameters["gate.speculate"].string_value == str(result.chosen is not None).lower()
        assert parameters["gate.epsilon"].string_value == f"{result.epsilon}"
        assert parameters["engine.device"].string_value == "cpu"  # the list is kept
        model = tmp_path / str(result.epsilon) / "prepos"
        model.mkdir(parents=True)
        (model / "config.pbtxt").write_text(text)
        check_repositories([model.parent], {})


def test_a_second_run_on_a_records_file_in_use_is_refused_and_repeated_records_count_once(parts, tmp_path):
    """Two runs on one --out each recorded every point, and the report counted the points twice: a tighter
    certificate than the data gives."""
    import fcntl

    path = tmp_path / "r.jsonl"
    _, replay = make_replay(parts)
    with path.open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a run writing to it
        with pytest.raises(ValueError, match="another prepos calibrate run is writing to"):
            replay.run(SESSIONS, path)
    assert path.read_text() == ""  # nothing written
    replay.run(SESSIONS, path)
    once = read_records(path)
    header_line, *lines = path.read_text().splitlines(keepends=True)
    path.write_text(header_line + "".join(lines) + "".join(lines))  # as two unlocked runs left it
    assert read_records(path) == once
    scores_apart = json.loads(lines[0])  # replayed with other prefix reuse: the scores' last bits differ
    scores_apart["variants"]["empty"]["p_max"] *= 1 - 1e-7
    path.write_text(header_line + "".join(lines) + json.dumps(scores_apart) + "\n")
    assert read_records(path) == once
    changed = json.loads(lines[0])
    changed["full_token_id"] += 1
    path.write_text(header_line + "".join(lines) + json.dumps(changed) + "\n")
    with pytest.raises(ValueError, match=f"r.jsonl:{len(lines) + 2}: session 'a' turn 1 is recorded again, with "
                       f"another outcome .* remove line {len(lines) + 2}"):
        read_records(path)
    path.write_text("".join(lines))  # records with no header line: not written by a replay
    with pytest.raises(ValueError, match="r.jsonl:1: not a calibration records file"):
        read_records(path)


@pytest.mark.parametrize("edit, named", [
    (lambda r: r["variants"]["empty"].update(agreed="yes"), "variants.empty.agreed"),
    (lambda r: r["variants"]["empty"].update(p_max="0.5"), "variants.empty.p_max"),
    (lambda r: r["variants"]["empty"].update(p_max=2.0), "variants.empty.p_max"),
    (lambda r: r.update(session=5), "session"),
    (lambda r: r.update(turn=-1), "turn"),
    (lambda r: r["variants"].pop("dots"), "speculative deltas"),
])
def test_a_record_edited_out_of_shape_is_refused_naming_its_line_and_field(parts, tmp_path, edit, named):
    path = tmp_path / "r.jsonl"
    make_replay(parts)[1].run(SESSIONS, path)
    header_line, first, *rest = path.read_text().splitlines(keepends=True)
    record = json.loads(first)
    edit(record)
    path.write_text(header_line + "".join(rest) + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"r.jsonl:{len(rest) + 2}: .*{re.escape(named)}"):
        read_records(path)
    path.write_text(header_line + "".join(rest) + json.dumps(record))  # without its newline: no truncated write
    with pytest.raises(ValueError, match=rf"r.jsonl:{len(rest) + 2}: .*{re.escape(named)}"):
        read_records(path)


def test_a_file_that_is_not_a_records_file_is_refused_and_left_as_it_was(parts, tmp_path):
    """Its one complete line was taken for a truncated record: the replay appended to the file, then failed."""
    for text in ("hi\n", "hi", "no\nrecords\n", '{"a": 1}', '{"a": 1}\n'):
        path = tmp_path / "afile"
        path.write_text(text)
        with pytest.raises(ValueError, match="afile:1: not a calibration record"):
            make_replay(parts)[1].run(SESSIONS, path)
        assert path.read_text() == text


def test_a_placeholder_with_control_characters_gives_a_fragment_triton_reads_back_as_it_was():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    placeholder = 'q=He said "ok" \\ é\nnext\t}\r\x01\x7f'
    features = SpeculativeFeatures(1, 0.999, 0.999, 0.1, 0.999, 2, True)
    records = [DecisionRecord(f"s{i}", 0, 5, 2, 1, (1,), {EMPTY: features, "q": features}) for i in range(600)]
    result = calibrate(records, epsilons=[0.05], delta=0.1, variants=["q"])[0]
    fragment = config_fragment(result, {"q": placeholder})
    assert len(fragment.splitlines()) == 2 + 7  # two comment lines, one line per parameter
    parameters = text_format.Parse(fragment, model_config_pb2.ModelConfig()).parameters
    assert parameters["gate.speculative_delta"].string_value == placeholder


def test_the_report_names_the_method_that_certified_and_says_so_of_a_held_out_part_that_answered_none(tmp_path):
    records = [_record(f"s{i}", 0, 0.999, True) for i in range(300)]
    # fixed_sequence stops at the grid's highest threshold, above every score: gate off, though lower thresholds
    # have bounds below epsilon; the report said that it had used Bonferroni
    results = calibrate(records, epsilons=[0.3], delta=0.1, method="fixed_sequence")
    assert results[0].chosen is None
    write_report(tmp_path / "fixed", records, results, title="t", placeholders={"dots": "..."}, held_out_fraction=0.5)
    report = (tmp_path / "fixed" / "report.md").read_text()
    assert "fixed-sequence testing" in report and "no answer at or above it" in report and "Bonferroni" not in report
    results = calibrate(records, epsilons=[0.3], delta=0.1, held_out_fraction=0.0)
    assert results[0].chosen is not None
    write_report(tmp_path / "none", records, results, title="t", placeholders={"dots": "..."}, held_out_fraction=0.0)
    report = (tmp_path / "none" / "report.md").read_text()
    assert "with Bonferroni" in report
    assert "Held out: 0/0 answered (coverage 0.000), no false-accept rate to observe" in report
    assert "[0.0000, 1.0000]" not in report  # a rate and interval over no answer


def test_a_report_removes_an_earlier_reports_fragments_for_epsilons_it_does_not_cover(tmp_path):
    records = [_record(f"s{i}", 0, 0.999, True) for i in range(300)]
    write_report(tmp_path, records, calibrate(records, epsilons=[0.1, 0.3], delta=0.1), title="t",
                 placeholders={"dots": "..."}, held_out_fraction=0.5)
    (tmp_path / "gate_notes.txt").write_text("mine")
    (tmp_path / "gate_eps0.1_edited.pbtxt").write_text("mine")
    write_report(tmp_path, records, calibrate(records, epsilons=[0.3], delta=0.1), title="t",
                 placeholders={"dots": "..."}, held_out_fraction=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate_eps0.1_edited.pbtxt", "gate_eps0.3.pbtxt",
                                                           "gate_notes.txt", "report.md", "risk_coverage.csv",
                                                           "risk_coverage.png"]
