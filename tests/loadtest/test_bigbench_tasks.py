"""BIG-bench task fetching and parsing on tiny synthetic archives (nothing is downloaded)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from prepos_loadtest import bigbench_tasks
from prepos_loadtest.bigbench_tasks import (
    TaskFormatError,
    extract_tasks,
    fetch_tasks,
    index_url,
    load_task,
    sdist_links,
    task_decision_points,
)

TASK = {
    "name": "tiny_yes_no",
    "task_prefix": "Answer the question.",
    "examples": [
        {"input": "Is water wet?", "target_scores": {"Yes": 1, "No": 0}},
        {"input": "Is fire cold?", "target_scores": {"Yes": 0, "No": 1}},
        {"input": "Is ice solid?", "target_scores": {"No": 0, "Yes": 1}},
    ],
}


def write_task(tmp_path, data) -> str:
    path = tmp_path / "task.json"
    path.write_text(json.dumps(data))
    return path


def sdist(members: dict[str, bytes]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def test_load_task_parses_options_and_targets(tmp_path):
    task = load_task(write_task(tmp_path, TASK))
    assert task.name == "tiny_yes_no" and task.options == ("No", "Yes")
    assert [(e.text, task.options[e.target_index]) for e in task.examples] == [
        ("Is water wet?", "Yes"), ("Is fire cold?", "No"), ("Is ice solid?", "Yes")]


@pytest.mark.parametrize(("change", "field"), [
    (lambda d: d.update(examples=[]), "'examples'"),
    (lambda d: d["examples"][1].update(target_scores={"Yes": 1, "No": 0, "Maybe": 0}), r"examples\[1\].target_scores"),
    (lambda d: d["examples"][2].update(target_scores={"True": 1, "False": 0}), r"examples\[2\].target_scores"),
    (lambda d: d["examples"][0].update(target_scores={"Yes": 1, "No": 1}), r"examples\[0\].target_scores"),
    (lambda d: d["examples"][0].update(input=""), r"examples\[0\].input"),
])
def test_non_binary_tasks_are_refused_naming_the_field(tmp_path, change, field):
    data = json.loads(json.dumps(TASK))
    change(data)
    with pytest.raises(TaskFormatError, match=field):
        load_task(write_task(tmp_path, data))


def test_decision_points_one_session_per_example(tmp_path):
    task = load_task(write_task(tmp_path, TASK))
    sessions = task_decision_points(task)
    assert [s.name for s in sessions] == ["tiny_yes_no_0", "tiny_yes_no_1", "tiny_yes_no_2"]
    system, user = sessions[1].steps
    assert system.role == "system" and system.max_tokens == 0 and "Answer the question." in system.delta
    assert "No or Yes" in system.delta
    assert (user.role, user.delta, user.max_tokens, user.choices, user.expected) == (
        "user", "Is fire cold?", 1, ("No", "Yes"), "No")
    picked = task_decision_points(task, 2, seed=1)
    assert len(picked) == 2 and picked == task_decision_points(task, 2, seed=1)
    with pytest.raises(ValueError, match="num_sessions"):
        task_decision_points(task, 0)


def test_extract_keeps_only_wanted_task_files(tmp_path):
    archive = sdist({
        "bigbench-1.0.0/bigbench/benchmark_tasks/aaa/task.json": b'{"a": 1}',
        "bigbench-1.0.0/bigbench/benchmark_tasks/tiny/README.md": b"readme",
        "bigbench-1.0.0/bigbench/benchmark_tasks/tiny/task.json": json.dumps(TASK).encode(),
        "bigbench-1.0.0/bigbench/benchmark_tasks/tiny/sub/task.json": b"{}",
    })
    found = extract_tasks(archive, ("tiny",), tmp_path)
    assert found == {"tiny": tmp_path / "tiny" / "task.json"}
    assert json.loads(found["tiny"].read_text()) == TASK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_sdist_links_from_a_simple_api_page():
    page = ('<html><body><a href="../../files/bigbench-0.9.tar.gz#sha256=aa">bigbench-0.9.tar.gz</a>'
            '<a href="https://files.example/bigbench-1.0.0-py3-none-any.whl">wheel</a>'
            '<a href="../../files/bigbench-1.0.0.tar.gz#sha256=bb">bigbench-1.0.0.tar.gz</a></body></html>')
    links = sdist_links(page, "https://index.example/simple/bigbench/")
    assert links == ["https://index.example/files/bigbench-0.9.tar.gz#sha256=aa",
                     "https://index.example/files/bigbench-1.0.0.tar.gz#sha256=bb"]


def test_index_url_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    assert index_url() == "https://mirror.example/simple"


def test_fetch_uses_the_cache_without_network(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "task.json").write_text(json.dumps(TASK))

    def no_network(*args, **kwargs):
        raise AssertionError("fetch_tasks went to the network with the task cached")

    monkeypatch.setattr(bigbench_tasks.urllib.request, "urlopen", no_network)
    assert fetch_tasks(("tiny",), tmp_path) == {"tiny": tmp_path / "tiny" / "task.json"}
