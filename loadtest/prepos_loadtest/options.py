"""Load-test options as frozen dataclasses, and the command-line flags generated from them.

The same dataclasses give the flags of a Locust run (added to Locust's parser
by the user class) and of ``python -m prepos_loadtest.run``, which forwards
them to Locust: one default and one help text per option.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prepos_client import DEFAULT_MODEL

from .replay import ReplayOptions

T = TypeVar("T")


@dataclass(frozen=True)
class WorkloadOptions:
    """Which sessions a load test replays, and against which model."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "Triton model name"})
    workload_sessions: int = field(default=32, metadata={
        "help": "distinct session traces built for a built-in workload (users cycle through them)"})
    workload_seed: int = field(default=0, metadata={"help": "seed of the workload's content and think times"})

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if self.workload_sessions < 1:
            raise ValueError(f"workload_sessions: must be >= 1, got {self.workload_sessions}")


OPTION_CLASSES = (WorkloadOptions, ReplayOptions)


def flag(name: str) -> str:
    """The command-line flag of a dataclass field: `think_scale` -> `--think-scale`."""
    return "--" + name.replace("_", "-")


def add_arguments(parser: Any, options_class: type) -> None:
    """Add one flag per field of `options_class` to an argparse (or Locust) parser, defaults from the class; a
    bool field is a switch (`--wait-for-ready` / `--no-wait-for-ready`)."""
    for option in dataclasses.fields(options_class):
        help_text = f"{option.metadata.get('help', '')} (default: %(default)s)"
        if isinstance(option.default, bool):
            parser.add_argument(flag(option.name), action=argparse.BooleanOptionalAction, default=option.default,
                                help=help_text)
        else:
            parser.add_argument(flag(option.name), type=type(option.default), default=option.default,
                                help=help_text)


def from_namespace(options_class: type[T], namespace: argparse.Namespace | None) -> T:
    """Build `options_class` from parsed flags; fields the namespace lacks keep their defaults.

    Raises:
        ValueError: a value the dataclass rejects (the message names the field).
    """
    values = {}
    for option in dataclasses.fields(options_class):
        value = getattr(namespace, option.name, None) if namespace is not None else None
        if value is not None:
            values[option.name] = value
    return options_class(**values)


def to_argv(options: Any) -> list[str]:
    """The flags that reproduce `options` (only fields that differ from their defaults)."""
    argv = []
    for option in dataclasses.fields(options):
        value = getattr(options, option.name)
        if value == option.default:
            continue
        if isinstance(value, bool):
            argv.append(flag(option.name) if value else "--no-" + flag(option.name)[2:])
        else:
            argv += [flag(option.name), str(value)]
    return argv
