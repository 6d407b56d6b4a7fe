"""`prepos chat`: a multi-turn session on stdin and stdout.

At a terminal it prompts, and Ctrl-C or Ctrl-D leave it (exit 0). Fed from a
pipe or file, each line is a turn: a line the server refuses, or one that is
not UTF-8 text, is reported on stderr and the chat goes on with the next; it
exits 1 at the end when any was refused, and 130 when interrupted.
"""

from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass

from .cli import (EXIT_INTERRUPTED, EXIT_OK, EXIT_SERVER_ERROR, add_connection_arguments, add_generation_arguments,
                  add_session_arguments, answer_status, check_session_arguments, connect, dim, generation_options,
                  open_session, session_hint, settle_for_message, stream_answer, told, update_status)
from .errors import PreposError, PreposUnavailable
from .session import Session

CHAT_HELP = """commands:
  /append TEXT   append TEXT without asking for an answer
  /role ROLE     role of the next delta (user, tool, system); dropped if that line is refused
  /quit          leave, closing the session unless --keep-open (also Ctrl-D, Ctrl-C)
  /help          this text
a line that starts with / is a command (an unknown one is refused); start it with a space to send it as text"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the commands' lines as written
    parser.epilog = "Each line is a turn; lines starting with / are chat " + CHAT_HELP
    add_connection_arguments(parser)
    add_session_arguments(parser)
    parser.add_argument("--system", help="system message appended when the session opens (not with --continue: "
                        "a continued session has its own)")
    parser.add_argument("--keep-open", action="store_true", help="leave the session open on exit (no END)")
    add_generation_arguments(parser)


@dataclass
class _Lines:
    """The chat's input: lines read, and how many of them were refused."""

    stream: io.TextIOBase
    interactive: bool
    num_read: int = 0
    num_refused: int = 0

    def read(self) -> str | None:
        if self.interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = self.stream.readline()
        if not line:
            return None
        self.num_read += 1
        return line.rstrip("\r\n")

    def refuse(self, message: str) -> None:
        self.num_refused += 1
        sys.stdout.flush()
        print(f"error: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    stdin = sys.stdin if sys.stdin is not None else io.StringIO("")  # closed (`<&-`): no lines, as an empty file
    if isinstance(stdin, io.TextIOWrapper):  # bytes that are not UTF-8 come as lone surrogates, whatever the locale
        stdin.reconfigure(errors="surrogateescape")
    lines = _Lines(stdin, interactive=stdin.isatty())
    options = generation_options(args)
    check_session_arguments(args)  # a usage error before the server is asked anything
    if args.resume and args.system is not None:
        raise ValueError("--system: a session chat continues (--continue) has its system message already; it is "
                         "appended only to a session chat opens")
    interrupted = False
    with connect(args) as client:
        if not args.wait_for_ready:
            # Sessions open at their first request: say now, not after the first line typed (or never, on an
            # empty stdin), that the server cannot be reached or the model is not ready.
            client.ensure_ready()
        try:
            # Left on Ctrl-C, open_session cancels the answer under way and tries the END once, not waiting for
            # the server within --timeout (--wait-for-ready), and a failure of that END is not the chat's exit
            with open_session(client, args, keep_open=args.keep_open) as session:
                if args.system is not None:
                    session.append(args.system, role="system")
                if lines.interactive:
                    print(dim(f"session {session.session_id} on {args.url}; /help for commands"), file=sys.stderr)
                _chat_loop(session, options, lines, args)
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            interrupted = True
    if lines.interactive:
        return EXIT_OK  # Ctrl-C, Ctrl-D and /quit are how a chat at a terminal ends
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_SERVER_ERROR if lines.num_refused else EXIT_OK


def _chat_loop(session: Session, options: dict, lines: _Lines, args: argparse.Namespace) -> None:
    """Run the chat's lines, counting those refused in ``lines``."""
    role = None
    while (line := lines.read()) is not None:
        command, _, rest = line.partition(" ")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as err:  # read with surrogateescape: bytes that are not UTF-8
            lines.refuse(f"line {lines.num_read}: not UTF-8 text (byte 0x{ord(line[err.start]) & 0xFF:02x} at "
                         f"character {err.start}); not sent")
            continue
        try:
            if command == "/quit":
                break
            if command == "/help":
                print(CHAT_HELP, file=sys.stderr)
            elif command == "/role":
                role = rest.strip() or None
            elif command == "/append":
                update = session.append(rest, role=role)
                role = None
                print(dim(update_status(update)), file=sys.stderr)
            elif command.startswith("/"):  # a typo of a command: refused, not sent as text, and told in the exit
                lines.refuse(f"line {lines.num_read}: unknown command {command!r}; /help for commands; not sent")
            elif line.strip():
                answer = stream_answer(session.generate(line, role=role, **options))
                role = None
                print(dim(answer_status(answer)), file=sys.stderr)
        except PreposUnavailable:
            raise
        except PreposError as error:
            if error.field == "resume" and error.status is None:
                raise  # --continue of a session the server neither holds nor has a journal of: no line can go on
            settle_for_message(session, error)
            reset = ""
            if role is not None:  # it went with the refused line (a role the model has no framing for, say): the
                # next line was not written for it
                role, reset = None, f" [/role {role} dropped: the next turns take the default role]"
            lines.refuse(f"{told(error)}{session_hint(error, args)}{reset}")
