"""The `prepos` command line: `chat`, `ask`, `append`, `close`, `serve`, `build`, `calibrate`.

Subcommands live in the `COMMANDS` registry. `register_command` adds one
defined here or in any module imported before `main` runs;
`register_module_command` adds one that hands its arguments to another
package's `main(argv)`, imported only when that subcommand runs (so the
client commands never pay for the server's imports).

Exit codes: 0 ok, 1 the server rejected a request (the message names the
field), its model is not ready, or a call ran out of --timeout (or the output
could not be written), 2 usage, 3 the server cannot be reached, 130
interrupted, 141 the reader of the output went away. `chat` reading lines
from a pipe or file goes on after a refused line (or one that is not UTF-8)
and exits 1 at the end when any was refused, 130 when interrupted; at a
terminal it exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .channel import Tls, check_url
from .client import DEFAULT_MODEL, DEFAULT_URL, Client
from .errors import PreposError, PreposTimeout, PreposUnavailable
from .protocol import Answer, Chunk, Update
from .deadlines import check_timeout
from .cli_messages import session_hint, settle_for_message, told, unreachable_hint  # noqa: F401 (chat_cli)
from .session import Session

logger = logging.getLogger("prepos")

EXIT_OK = 0
EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell tool whose reader went away
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT})  # the output cannot be written

URL_ENV = "PREPOS_URL"
TOKEN_ENV = "PREPOS_ACCESS_TOKEN"


@dataclass(frozen=True)
class Command:
    """A subcommand: `add_arguments(parser)` declares its flags, `run(args)` returns the exit code.

    With `forwards_argv`, the subcommand declares no flags of its own: the
    arguments after its name reach `run` unparsed, as `args.argv`.
    """

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    forwards_argv: bool = False


COMMANDS: dict[str, Command] = {}


def register_command(
    name: str,
    *,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """Add (or replace) the subcommand `name`."""
    COMMANDS[name] = Command(help, add_arguments, run)


def register_module_command(name: str, module: str, *, help: str) -> None:
    """Add (or replace) the subcommand `name` as `module.main(argv) -> int`.

    `argv` is everything after the subcommand's name, `--help` included.
    """

    def run(args: argparse.Namespace) -> int:
        try:
            entry_point = importlib.import_module(module).main
        except ImportError as error:
            print(f"prepos {name} is unavailable here: {error}", file=sys.stderr)
            return EXIT_USAGE
        return entry_point(args.argv)

    COMMANDS[name] = Command(help, lambda parser: None, run, forwards_argv=True)


def _url(value: str) -> str:
    try:
        return check_url(value)
    except ValueError as error:
        source = f" (from {URL_ENV})" if value == os.environ.get(URL_ENV) else ""
        raise argparse.ArgumentTypeError(f"{str(error).removeprefix('url: ')}{source}") from None


def _timeout(value: str) -> float:
    try:
        return check_timeout(float(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0 (inf for no limit), got {value!r}") from None


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """--url, --model, --timeout: where the server is and how long a call may take."""
    parser.add_argument(
        "--url",
        type=_url,
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"gRPC host:port of the server (env {URL_ENV}; default %(default)s)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="Triton model name (default %(default)s)")
    parser.add_argument("--timeout", type=_timeout, dest="timeout_s",
                        help="seconds one call may take (> 0; inf: no limit); a call that runs out of it is given as "
                        "long again to learn what became of it and end the session")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"the server's access token (env {TOKEN_ENV}, which keeps it out of the process list)",
    )
    parser.add_argument(
        "--wait-for-ready",
        action="store_true",
        help="a call that finds the server stopping, restarting or down waits for it, within --timeout, and is "
        "sent again once it is ready, instead of failing at once",
    )
    parser.add_argument("--tls", action="store_true",
                        help="gRPC over TLS, the server's certificate checked against the system's roots (the Helm "
                        "chart's router with router.tls.enabled)")
    parser.add_argument("--tls-ca", metavar="FILE", help="gRPC over TLS, the server's certificate checked against "
                        "the PEM roots in FILE (implies --tls)")
    parser.add_argument("--tls-server-name", metavar="NAME", help="the name the server's certificate must carry, "
                        "where it is not --url's host (a port-forward to localhost; implies --tls)")


def add_session_arguments(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """--session-id and --continue."""
    parser.add_argument("--session-id", required=required,
                        help="session id" if required else "session id (default: a fresh random one)")
    parser.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="go on with a session opened earlier (left open with --keep-open, or before a restart): START is sent "
        "with resume, so the server continues the session it holds or reopens it from its journal",
    )


def _comma_list(value: str) -> list[str]:
    # "yes, no" meant yes and no: " no", a token of its own, was all but never chosen
    items = [item.strip() for item in value.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"an empty entry in {value!r}: give entries separated by single commas")
    return items


# Flag -> argparse options; each becomes a keyword of Session.generate when set.
# Defaults stay None so that the library's and the server's defaults apply.
_GENERATION_FLAGS: dict[str, dict] = {
    "--max-tokens": dict(type=int, help="tokens to generate (default: the server's scheduler.default_max_tokens)"),
    "--choices": dict(type=_comma_list, help="closed answer set, comma-separated, spaces around entries dropped: "
                      "yes,no"),
    "--temperature": dict(type=float, help="sampling temperature (greedy when unset)"),
    "--top-p": dict(type=float, help="nucleus sampling mass"),
    "--top-k": dict(type=int, help="sample from the k most likely tokens"),
    "--seed": dict(type=int, help="sampling seed"),
    "--stop": dict(action="append", help="stop string (repeatable)"),
    "--speculate": dict(action=argparse.BooleanOptionalAction, help="allow the gated path"),
    "--gate-threshold": dict(type=float, help="gate threshold for this request"),
}
GENERATION_OPTIONS = tuple(flag[2:].replace("-", "_") for flag in _GENERATION_FLAGS)


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the options of a generate request (all optional)."""
    group = parser.add_argument_group("generation")
    for flag, options in _GENERATION_FLAGS.items():
        group.add_argument(flag, default=None, **options)


def generation_options(args: argparse.Namespace) -> dict:
    """The generation flags that were given, as keywords for `Session.generate`."""
    return {name: getattr(args, name) for name in GENERATION_OPTIONS if getattr(args, name, None) is not None}


def connect(args: argparse.Namespace) -> Client:
    """A Client for the connection flags of `args`."""
    options = {} if args.timeout_s is None else {"timeout_s": args.timeout_s}
    tls_ca, server_name = getattr(args, "tls_ca", None), getattr(args, "tls_server_name", None)
    tls = (Tls(root_certificates=tls_ca, server_name=server_name) if tls_ca is not None or server_name is not None
           else getattr(args, "tls", False))
    return Client(args.url, args.model, token=getattr(args, "token", None),
                  wait_for_ready=getattr(args, "wait_for_ready", False), tls=tls, **options)


def check_session_arguments(args: argparse.Namespace) -> None:
    """Raise ValueError (a usage error) for session flags that do not go together."""
    if args.resume and args.session_id is None:
        raise ValueError("--continue needs --session-id: the session to go on with")


@contextlib.contextmanager
def open_session(client: Client, args: argparse.Namespace, *, keep_open: bool) -> Iterator[Session]:
    """Yield the session of `args`; on exit, close it (END) or, with keep_open, leave it open (saying its id on
    stderr when it was made up here: the only way to go on with it)."""
    check_session_arguments(args)
    session = client.session(args.session_id, resume=args.resume)
    try:
        yield session
    except BaseException as error:
        # Leaving on an error takes one more time limit in all: learning what became of a call that timed out, then
        # the END (which waits for that outcome first; against a silent server each took a whole limit of its own).
        leave_by = time.perf_counter() + session.timeout_s
        settle_for_message(session, error, timeout_s=time_left(leave_by))
        if keep_open:
            _leave_open(session, made_up=args.session_id is None)
        else:
            session.wait_for_ready = False  # leaving on an error: END is tried once, not waited for
            if isinstance(error, (KeyboardInterrupt, BrokenPipeError)):
                session.cancel()  # the answer no one reads any more: END waited for it to run to its end
            with contextlib.suppress(PreposError):
                session.close(timeout_s=time_left(leave_by))
        raise
    if keep_open:
        _leave_open(session, made_up=args.session_id is None)
    else:
        session.close()


def time_left(deadline: float) -> float:
    """Seconds to `deadline` as a time limit: at least a millisecond (a limit must be above 0), infinity for none."""
    return max(deadline - time.perf_counter(), 0.001)


def _leave_open(session: Session, *, made_up: bool) -> None:
    """Detach the session; say its id when it was made up here and was opened on the server (the only way to go on
    with it), or that it was not (no request, or its first refused or cut short: there is nothing to go on with)."""
    opened = session.opened
    session.detach()
    if not made_up:
        return
    if opened:
        print(dim(f"[session {session.session_id} is left open: go on with --session-id {session.session_id} "
                  "--continue]"), file=sys.stderr)
    else:
        print(dim(f"[session {session.session_id} was not opened on the server: nothing to go on with]"),
              file=sys.stderr)


def dim(text: str) -> str:
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[2m{text}\x1b[0m"
    return text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}ms"


def answer_status(answer: Answer) -> str:
    """One status line: served path, gate confidence, client TTFT, server first-token time."""
    confidence = "-" if answer.confidence is None else f"{answer.confidence:.2f}"
    return (
        f"[path={answer.path or '-'} confidence={confidence} ttft={_ms(answer.ttft_ms)} "
        f"server_first_token={_ms(answer.first_token_ms)}]"
    )


def update_status(update: Update) -> str:
    """One status line for an append or close acknowledgement."""
    return f"[path={update.path or '-'} total={_ms(update.total_ms)}]"


def stream_answer(chunks: Iterator[Chunk]) -> Answer:
    """Print the answer's text to stdout as it arrives; return the collected Answer."""
    received = []
    try:
        for chunk in chunks:
            received.append(chunk)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    finally:
        if received or sys.exc_info()[0] is None:  # an answer cut short still ends its line before the error
            sys.stdout.write("\n")
            sys.stdout.flush()
    return Answer.from_chunks(received)


def _print_json(data: dict) -> None:
    print(json.dumps(data, ensure_ascii=False))


# --- ask ---------------------------------------------------------------------


def _add_ask_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the question (the delta); '' for an empty delta")
    add_connection_arguments(parser)
    add_session_arguments(parser)
    parser.add_argument("--role", help="role of the delta: user (server default), tool, system")
    parser.add_argument("--keep-open", action="store_true", help="leave the session open (no END)")
    parser.add_argument("--json", action="store_true",
                        help="print the Answer as one JSON object (with its session_id; errors go to stderr as text; "
                        "prefill_ms, decode_ms and scan_ms are the first token's, compute_ms the whole answer's)")
    add_generation_arguments(parser)


def _run_ask(args: argparse.Namespace) -> int:
    with connect(args) as client, open_session(client, args, keep_open=args.keep_open) as session:
        chunks = session.generate(args.text, role=args.role, end=not args.keep_open, **generation_options(args))
        if args.json:
            _print_json({"session_id": session.session_id, **Answer.from_chunks(list(chunks)).to_dict()})
        else:
            stream_answer(chunks)
    return EXIT_OK


# --- append ------------------------------------------------------------------


def _add_append_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the delta to append")
    add_connection_arguments(parser)
    add_session_arguments(parser, required=True)
    parser.add_argument("--role", help="role of the delta: user (server default), tool, system")
    parser.add_argument("--end", action="store_true", help="close the session with this append")
    parser.add_argument("--json", action="store_true",
                        help="print the acknowledgement as one JSON object (with its session_id)")


def _run_append(args: argparse.Namespace) -> int:
    with connect(args) as client, open_session(client, args, keep_open=not args.end) as session:
        update = session.append(args.text, role=args.role, end=args.end)
        if args.json:
            _print_json({"session_id": session.session_id, **update.to_dict()})
    return EXIT_OK


# --- close -------------------------------------------------------------------


def _add_close_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("--session-id", required=True, help="id of the open session to close")
    parser.add_argument("--json", action="store_true",
                        help="print the acknowledgement as one JSON object (with its session_id)")


def _run_close(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            update = client.session(args.session_id, resume=True).close()
        except PreposTimeout as error:
            if error.field == "timeout":  # the server's own deadline error: it stopped the END, which closed nothing
                raise error.reworded(f"session {args.session_id}: the server stopped the close at its deadline; "
                                     "the session may still be open: run close again") from None
            raise PreposTimeout(f"session {args.session_id}: the close was not answered within the time limit; the "
                                "session may still be open: run close again", field=error.field,
                                status=error.status, code=error.code) from None
        if update is None:  # the server holds neither the session nor a journal of it
            raise PreposError(f"session {args.session_id} is not open on the server (closed already, ended by its "
                              "idle timeout, or never opened), and no journal of it is left: nothing to close",
                              field="resume")
        if args.json:
            _print_json({"session_id": args.session_id, **update.to_dict()})
    return EXIT_OK


# --- entry point ---------------------------------------------------------------

def _chat_cli():
    return importlib.import_module(".chat_cli", __package__)  # it builds on this module


register_command(
    "chat",
    help="interactive multi-turn session on stdin/stdout",
    add_arguments=lambda parser: _chat_cli().add_arguments(parser),
    run=lambda args: _chat_cli().run(args),
)
register_command("ask", help="ask one question and print the answer", add_arguments=_add_ask_arguments, run=_run_ask)
register_command(
    "append",
    help="append a delta to a session without an answer",
    add_arguments=_add_append_arguments,
    run=_run_append,
)
register_command("close", help="close an open session (END)", add_arguments=_add_close_arguments, run=_run_close)
register_module_command("serve", "prepos.launcher", help="start Triton with the prepos model repository")
register_module_command("build", "prepos_build.__main__", help="build an engine directory from a checkpoint")
register_module_command("calibrate", "prepos_client.calibrate_cli", help="certify a gate threshold on a trace, offline")


def _installed_version() -> str:
    """The installed prepos package's version ("unknown" for a copy run from its folder, not installed)."""
    from importlib import metadata

    try:
        return metadata.version("prepos")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The `prepos` parser with every registered subcommand (each subcommand's parser in its ``subparsers``
    attribute)."""
    parser = argparse.ArgumentParser(prog="prepos", description="prepos: stateful LLM sessions on Triton",
                                     epilog="exit codes: " + __doc__.split("Exit codes: ", 1)[1].strip())
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"prepos {_installed_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        subparser = subparsers.add_parser(
            name, help=command.help, description=command.help, add_help=not command.forwards_argv
        )
        command.add_arguments(subparser)
    parser.subparsers = subparsers.choices
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `prepos` command line; return its exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    command = COMMANDS[args.command]
    if command.forwards_argv:
        args.argv = extra
        return command.run(args)
    if extra:
        parser.subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if sys.stdout is None:  # started with stdout closed (`>&-`): nothing could be written, not even by print
        print(f"prepos {args.command}: cannot write the output: stdout is closed", file=sys.stderr or sys.__stderr__)
        return EXIT_SERVER_ERROR
    level = logging.DEBUG if args.verbose else logging.WARNING
    logging.basicConfig(format="prepos: %(levelname)s: %(message)s", level=level)
    try:
        return command.run(args)
    except PreposUnavailable as error:
        url = getattr(args, "url", "the configured address")
        print(f"prepos: cannot reach prepos at {url}: {unreachable_hint(error, args)} ({error})", file=sys.stderr)
        return EXIT_UNREACHABLE
    except PreposTimeout as error:
        print(f"prepos: error: {told(error)}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except PreposError as error:
        print(f"prepos: error: {error}{session_hint(error, args)}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except ValueError as error:
        print(f"prepos {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # stdout closed early (`prepos ask ... | head`): stop quietly, as a shell tool does
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as error:
        if error.errno not in _WRITE_ERRNOS or error.filename is not None:  # not the output's
            raise
        _drop_stdout()  # the output cannot be written (`> /dev/full`): say so, as `cat` does, not with a traceback
        print(f"prepos: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return EXIT_SERVER_ERROR


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that the exit's own flush of what could not be written has nowhere to fail."""
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
