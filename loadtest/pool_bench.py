"""KV pool benchmark: what the paged engine's pool holds for agent sessions that open alike.

Loads the engine into ``PagedTorchLlamaEngine`` (the torch engine on CUDA: a
static pool of pages; on a machine without a GPU its attention kernel runs
under Triton's interpreter) and opens ``--sessions`` BFCL multi-turn sessions
one after another, each prefilling its system turn (the involved classes' tool
list) and its first question, framed as the server frames them. The same
sessions then run on a second engine with ``share_prefixes`` off. Reported: the
pool bytes held (pages in use, a page that several sessions share counted
once), the bytes the sessions' own block tables name (what copies would hold),
the tokens computed and shared, and how many sessions get the same greedy first
answer token with sharing on and off.

    python loadtest/pool_bench.py [--sessions 40] [--page-tokens 64] [--out out/pool_bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("backend", "loadtest"):
    sys.path.insert(0, str(ROOT / sub))

import torch  # noqa: E402

from prepos.template import EngineManifest, Tokenizer  # noqa: E402
from prepos_loadtest.repository import check_engine_dir, check_out_dir, machine, write_table  # noqa: E402
from prepos_loadtest.workloads import bfcl_sessions  # noqa: E402

MB = 1e6


def opening_ids(traces, engine_dir: Path) -> list[list[int]]:
    """Each trace's system turn and first question as the server frames them, up to the question's cue."""
    framing, tokenizer = EngineManifest.load(engine_dir).framing, Tokenizer(engine_dir / "tokenizer.json")
    openings = []
    for trace in traces:
        system, question = trace.steps[0], trace.steps[1]
        openings.append([*framing.entry_ids[system.role], *tokenizer.encode(system.delta), *framing.close_ids,
                         *framing.entry_ids[question.role], *tokenizer.encode(question.delta), *framing.cue_ids])
    return openings


def run(engine_dir: Path, openings: list[list[int]], page_tokens: int, share: bool) -> dict:
    """Prefill every opening on a fresh paged engine, one session each; the pool's figures and each first token."""
    from prepos.engines.torch_paged import PagedTorchLlamaEngine

    pages = sum(-(-len(ids) // page_tokens) for ids in openings) + 1  # every session's own pages, and scratch
    engine = PagedTorchLlamaEngine(str(engine_dir), device="cuda" if torch.cuda.is_available() else "cpu",
                                   page_tokens=page_tokens, max_batch=1, share_prefixes=share,
                                   kv_pool_bytes=_pool_bytes(engine_dir, pages, page_tokens))
    firsts = []
    for n, ids in enumerate(openings):
        firsts.append(int(engine.prefill(f"s{n}", ids).argmax()))
    named = sum(engine.kv_bytes(f"s{n}") for n in range(len(openings)))
    return {"pool_bytes": engine.kv_total_bytes(), "named_bytes": named, "computed": engine.num_computed_tokens,
            "shared": engine.num_shared_tokens, "firsts": firsts}


def _pool_bytes(engine_dir: Path, pages: int, page_tokens: int) -> int:
    """Bytes of a float32 pool of ``pages`` pages for the engine's model (its KV shape from its config)."""
    cfg = json.loads((engine_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return pages * page_tokens * 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4


def summarize(on: dict, off: dict, openings: list[list[int]], page_tokens: int, machine: str) -> str:
    n = len(openings)
    same = sum(a == b for a, b in zip(on["firsts"], off["firsts"]))
    lengths = [len(ids) for ids in openings]
    rows = [
        f"{n} BFCL sessions' system turn and first question ({min(lengths)}-{max(lengths)} tokens, median "
        f"{statistics.median(lengths):g}), one session after another, pages of {page_tokens} tokens; {machine}",
        "",
        "| sharing | pool held | block tables name | tokens computed | tokens shared |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("on (by reference)", on), ("off", off)):
        rows.append(f"| {name} | {r['pool_bytes'] / MB:.1f} MB | {r['named_bytes'] / MB:.1f} MB | {r['computed']} | "
                    f"{r['shared']} |")
    rows += ["", f"Same greedy first token with sharing on and off: {same} of {n}."]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=40, help="BFCL sessions (1-200, default %(default)s)")
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per page, a power of two (%(default)s)")
    parser.add_argument("--engine-dir", type=Path, default=ROOT / "engines" / "smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "pool_bench")
    args = parser.parse_args(argv)
    if not 1 <= args.sessions <= 200:
        parser.error(f"--sessions: must be in [1, 200], got {args.sessions}")
    if not 1 <= args.page_tokens <= 4096 or args.page_tokens & (args.page_tokens - 1):
        parser.error(f"--page-tokens: must be a power of two in [1, 4096], got {args.page_tokens}")
    check_engine_dir(parser, args.engine_dir)
    check_out_dir(parser, args.out)
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: the kernel runs interpreted
    openings = opening_ids(bfcl_sessions(args.sessions), args.engine_dir)
    on = run(args.engine_dir, openings, args.page_tokens, share=True)
    off = run(args.engine_dir, openings, args.page_tokens, share=False)
    where = f"{torch.cuda.get_device_name()}, {machine()}" if torch.cuda.is_available() else machine()
    write_table(args.out / "pool_bench.md", summarize(on, off, openings, args.page_tokens, where))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
