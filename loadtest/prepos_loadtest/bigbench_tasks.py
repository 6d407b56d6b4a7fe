"""BIG-bench yes/no tasks as single-turn decision points, fetched without installing ``bigbench``.

The ``bigbench`` distribution cannot be installed with pip (its metadata declares a
direct-URL dependency) and its sdist is large, but every task is one ``task.json``
inside that sdist. :func:`fetch_tasks` reads the simple-API page of the package
index pip is configured with, streams the sdist once and keeps only the wanted
``benchmark_tasks/<name>/task.json`` members in a cache directory. Nothing is
downloaded when the cache already holds the task.

:func:`load_task` parses a cached (or any) ``task.json`` into :class:`BinaryTask`;
:func:`task_decision_points` turns its examples into single-turn decision points
whose choices are the task's answer options and whose delta is the example text.
"""

from __future__ import annotations

import html.parser
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .workloads import SessionTrace, Step

logger = logging.getLogger(__name__)

PACKAGE = "bigbench"
DEFAULT_CACHE_DIR = Path(".cache/bigbench")
# Binary tasks whose answer options are one word each; the first is the default workload.
YES_NO_TASKS = ("causal_judgment", "navigate", "sports_understanding")
SYSTEM_PROMPT = (
    "You answer each question with exactly one of the allowed answers and nothing else."
)


class TaskFormatError(ValueError):
    """A task.json that is not a binary multiple-choice task; the message names the field."""


@dataclass(frozen=True)
class BinaryExample:
    """One example: the question text and the index of the correct option."""

    text: str
    target_index: int


@dataclass(frozen=True)
class BinaryTask:
    """A two-option task: ``options`` in a fixed order, its examples, and its prefix."""

    name: str
    options: tuple[str, str]
    examples: tuple[BinaryExample, ...]
    task_prefix: str


def index_url() -> str:
    """The simple-API index pip would use: ``PIP_INDEX_URL``, then pip's config, then pip's default."""
    env = os.environ.get("PIP_INDEX_URL")
    if env:
        return env.split()[0]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
            capture_output=True, text=True, timeout=60, check=False,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    from pip._internal.models.index import PyPI  # pip's own default, not restated here

    return PyPI.simple_url


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def sdist_links(page_html: str, base_url: str) -> list[str]:
    """Absolute URLs of the ``.tar.gz`` files linked from a simple-API project page, newest name last."""
    parser = _LinkParser()
    parser.feed(page_html)
    links = [urllib.parse.urljoin(base_url, h) for h in parser.hrefs]
    sdists = [u for u in links if urllib.parse.urlparse(u).path.endswith(".tar.gz")]
    return sorted(sdists, key=lambda u: urllib.parse.urlparse(u).path.rsplit("/", 1)[-1])


def _task_name_of(member_name: str) -> str | None:
    parts = member_name.split("/")
    if len(parts) >= 3 and parts[-1] == "task.json" and parts[-3] == "benchmark_tasks":
        return parts[-2]
    return None


def extract_tasks(stream, names: tuple[str, ...], cache_dir: Path) -> dict[str, Path]:
    """Read a gzip tar stream once, writing ``<cache_dir>/<name>/task.json`` for each wanted task.

    Stops reading as soon as every wanted task was found. Returns the paths written.
    """
    wanted = set(names)
    found: dict[str, Path] = {}
    with tarfile.open(fileobj=stream, mode="r|gz") as archive:
        for member in archive:
            name = _task_name_of(member.name)
            if name is None or name not in wanted or not member.isfile():
                continue
            source = archive.extractfile(member)
            target = cache_dir / name / "task.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".part")
            with open(tmp, "wb") as out:
                shutil.copyfileobj(source, out)
            tmp.replace(target)
            found[name] = target
            logger.info("extracted %s", target)
            if wanted <= found.keys():
                break
    return found


def fetch_tasks(names: tuple[str, ...] = YES_NO_TASKS, cache_dir: Path = DEFAULT_CACHE_DIR) -> dict[str, Path]:
    """Ensure ``<cache_dir>/<name>/task.json`` exists for each name; download only what is missing."""
    cache_dir = Path(cache_dir)
    have = {n: cache_dir / n / "task.json" for n in names if (cache_dir / n / "task.json").is_file()}
    missing = tuple(n for n in names if n not in have)
    if not missing:
        return have
    base = index_url().rstrip("/") + f"/{PACKAGE}/"
    with urllib.request.urlopen(base, timeout=120) as response:
        page = response.read().decode("utf-8", "replace")
    links = sdist_links(page, base)
    if not links:
        raise RuntimeError(f"no sdist of {PACKAGE} listed on the package index page {base}")
    url = links[-1]
    logger.info("streaming %s for tasks %s", url.split("#")[0], ", ".join(missing))
    with urllib.request.urlopen(url, timeout=600) as response:
        have.update(extract_tasks(response, missing, cache_dir))
    absent = [n for n in missing if n not in have]
    if absent:
        raise RuntimeError(f"tasks not found in the {PACKAGE} sdist: {', '.join(absent)}")
    return have


def load_task(path: Path, name: str | None = None) -> BinaryTask:
    """Parse a BIG-bench ``task.json`` with two-option ``target_scores`` into a :class:`BinaryTask`.

    Raises :class:`TaskFormatError` naming the field when the task is not binary.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    examples = data.get("examples")
    if not isinstance(examples, list) or not examples:
        raise TaskFormatError(f"{path}: 'examples' must be a non-empty list")
    options: tuple[str, str] | None = None
    parsed: list[BinaryExample] = []
    for i, ex in enumerate(examples):
        scores = ex.get("target_scores")
        if not isinstance(scores, dict) or len(scores) != 2:
            raise TaskFormatError(f"{path}: examples[{i}].target_scores must map exactly two options")
        keys = tuple(sorted(scores))
        if options is None:
            options = keys
        elif keys != options:
            raise TaskFormatError(f"{path}: examples[{i}].target_scores options {keys} differ from {options}")
        best = [k for k in options if scores[k] == max(scores.values())]
        if len(best) != 1:
            raise TaskFormatError(f"{path}: examples[{i}].target_scores has no single correct option")
        text = ex.get("input")
        if not isinstance(text, str) or not text.strip():
            raise TaskFormatError(f"{path}: examples[{i}].input must be a non-empty string")
        parsed.append(BinaryExample(text=text.strip(), target_index=options.index(best[0])))
    return BinaryTask(
        name=name or data.get("name") or Path(path).parent.name,
        options=options,
        examples=tuple(parsed),
        task_prefix=str(data.get("task_prefix", "")).strip(),
    )


def task_decision_points(task: BinaryTask, num_sessions: int | None = None, *, seed: int = 0) -> list[SessionTrace]:
    """One single-turn session per example: a fixed system instruction, then the example as the delta.

    The user turn's ``choices`` are the task's options and ``expected`` the
    correct one. ``num_sessions`` examples are drawn without replacement with
    ``seed`` (all, in file order, when None).
    """
    examples = list(enumerate(task.examples))
    if num_sessions is not None:
        if num_sessions < 1:
            raise ValueError(f"num_sessions: must be >= 1, got {num_sessions}")
        examples = random.Random(seed).sample(examples, min(num_sessions, len(examples)))
    options = " or ".join(task.options)
    system = f"{SYSTEM_PROMPT} {task.task_prefix} Answer {options}.".replace("  ", " ").strip()
    return [
        SessionTrace(f"{task.name}_{index}", (
            Step(0.0, "system", system, 0),
            Step(0.0, "user", example.text, 1, task.options, task.options[example.target_index]),
        ))
        for index, example in examples
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Fetch BIG-bench task.json files into a cache.")
    parser.add_argument("tasks", nargs="*", default=list(YES_NO_TASKS))
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name, path in fetch_tasks(tuple(args.tasks), args.cache_dir).items():
        task = load_task(path, name)
        logger.info("%s: %d examples, options %s", name, len(task.examples), task.options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
