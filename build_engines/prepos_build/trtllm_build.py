"""``python -m prepos_build.trtllm_build``: a TensorRT-LLM engine for the ``trtllm`` engine, and the config to serve it.

The prepos contract needs three things of a TensorRT-LLM engine, all fixed at
build time:

- **Paged KV with paged context FMHA**, so a request whose prompt extends a
  cached prefix reuses that prefix's KV blocks and computes only the new tokens
  (every prefix a session sends is its whole token log).
- **Small KV blocks** (``--tokens-per-block``, 16 by default): only full blocks are
  reused, so the tokens of the last partial block are recomputed on every request.
  Small blocks make that remainder small, at some cost in block-table size.
- **Generation-logit gathering**, so the distribution at the decision point can be
  returned where the logits post-processor is not available.

Steps, each one a command (``--dry-run`` prints them with the environment they
need and touches nothing, also where TensorRT-LLM is absent):

1. ``convert``: the Hugging Face checkpoint to a TensorRT-LLM checkpoint, through
   TensorRT-LLM's model classes (``from_hugging_face`` then ``save_checkpoint``).
2. ``build``: ``trtllm-build`` with the flags above and the size limits.
3. record the settings in ``trtllm/prepos_trtllm.json`` (read by ``prepos.engines.trtllm_dir``)
   and move the engine into ``<engine dir>/trtllm/``: a build interrupted at any step
   leaves the previous engine, or none, never half of one.
4. fill the model repository's ``prepos/config.pbtxt`` (``engine.name trtllm``,
   ``engine.device cuda``, ``engine.dir``, a GPU instance), or write it to ``--config-out``.

An engine built with the same settings from the same checkpoint is reused unless ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger("prepos_build.trtllm")

SUBDIR = "trtllm"
SETTINGS_FILE = "prepos_trtllm.json"
CONTAINER = "NVIDIA's Triton TensorRT-LLM container"
DTYPES = ("float16", "bfloat16", "float32")
# Hugging Face architecture -> TensorRT-LLM model class that converts it
MODEL_CLASSES = {
    "LlamaForCausalLM": "LLaMAForCausalLM",
    "MistralForCausalLM": "LLaMAForCausalLM",
    "Qwen2ForCausalLM": "QWenForCausalLM",
}


class TrtllmBuildError(RuntimeError):
    """A build that cannot run or did not finish; the message names the argument or step."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def shell(self) -> str:
        """The step as one shell line, environment first."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env), *map(shlex.quote, self.argv)])


@dataclass(frozen=True)
class TrtllmBuildSettings:
    """Everything that decides the engine; two builds with equal settings give the same engine."""

    source: str  # Hugging Face checkpoint directory (a prepos engine directory is one)
    architecture: str
    dtype: str = "bfloat16"
    tokens_per_block: int = 16
    max_batch_size: int = 64
    max_input_len: int = 8192
    max_seq_len: int = 8192
    max_num_tokens: int = 8192
    gather_generation_logits: bool = True
    paged_context_fmha: bool = True

    def __post_init__(self) -> None:
        def check(ok: bool, arg: str, problem: str) -> None:
            if not ok:
                raise TrtllmBuildError(f"--{arg.replace('_', '-')}: {problem}")

        check(self.dtype in DTYPES, "dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        t = self.tokens_per_block
        check(1 <= t <= 512 and not t & (t - 1), "tokens_per_block", f"must be a power of two in [1, 512], got {t}")
        for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens"):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        check(self.max_input_len < self.max_seq_len, "max_input_len",
              f"{self.max_input_len} must be below --max-seq-len {self.max_seq_len} (room for the generated token)")
        check(self.architecture in MODEL_CLASSES, "engine_dir",
              f"architecture {self.architecture!r} is not one this builder converts ({', '.join(MODEL_CLASSES)})")

    def record(self, version: str) -> dict:
        """``prepos_trtllm.json``: the settings plus the TensorRT-LLM version that built the engine."""
        return {**dataclasses.asdict(self), "tensorrt_llm_version": version}


def _json_object(path: Path) -> dict:
    """The JSON object in ``path``; raises TrtllmBuildError naming ``--engine-dir`` and the file otherwise."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise TrtllmBuildError(f"--engine-dir: cannot read {path} as JSON ({error})") from None
    if not isinstance(value, dict):
        raise TrtllmBuildError(f"--engine-dir: {path} holds {type(value).__name__}, not a JSON object")
    return value


def read_source(source: Path, max_seq_len: int = 0) -> tuple[str, int]:
    """The checkpoint's architecture and context length (the prepos manifest's, else the model config's; none
    needed where ``max_seq_len`` is given)."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise TrtllmBuildError(f"--engine-dir: {config_path} not found (a Hugging Face causal-LM directory is "
                               "needed)")
    config = _json_object(config_path)
    architectures = config.get("architectures") or ["?"]
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise TrtllmBuildError(f"--engine-dir: {config_path}: architectures must be a list of class names, got "
                               f"{json.dumps(architectures)}")
    try:
        context = int(config.get("max_position_embeddings") or 0)
        manifest = source / "prepos_engine.json"
        if manifest.is_file():
            context = int(_json_object(manifest).get("max_context") or context)
    except (TypeError, ValueError) as error:
        raise TrtllmBuildError(f"--engine-dir: {source} gives a context length that is not a number ({error})") \
            from None
    if context < 2 and not max_seq_len:
        raise TrtllmBuildError(f"--engine-dir: {config_path} gives no context length; pass --max-seq-len")
    return str(architectures[0]), context


def plan(settings: TrtllmBuildSettings, output: Path, python: str = sys.executable) -> list[Step]:
    """The commands that build ``settings`` into ``output``'s staging directories (pure: runs nothing)."""
    checkpoint, staging = _checkpoint_dir(output), _staging_dir(output)
    convert = (
        f"from tensorrt_llm.models import {MODEL_CLASSES[settings.architecture]} as M; "
        f"M.from_hugging_face({settings.source!r}, dtype={settings.dtype!r}).save_checkpoint({str(checkpoint)!r})"
    )
    build = [
        "trtllm-build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(staging),
        "--kv_cache_type", "paged",
        "--use_paged_context_fmha", "enable" if settings.paged_context_fmha else "disable",
        "--tokens_per_block", str(settings.tokens_per_block),
        "--max_batch_size", str(settings.max_batch_size),
        "--max_input_len", str(settings.max_input_len),
        "--max_seq_len", str(settings.max_seq_len),
        "--max_num_tokens", str(settings.max_num_tokens),
        "--gemm_plugin", "auto",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
    ]
    if settings.gather_generation_logits:
        build.append("--gather_generation_logits")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPU the build runs on, passed on where it is chosen
    env = (("CUDA_VISIBLE_DEVICES", visible),) if visible is not None else ()
    return [Step("convert", (python, "-c", convert), env), Step("build", tuple(build), env)]


def _checkpoint_dir(output: Path) -> Path:
    return output / f".{SUBDIR}-checkpoint"


def _staging_dir(output: Path) -> Path:
    return output / f".{SUBDIR}-staging"


# ---- the model repository's config ----------------------------------------------------------

_ENTRY = r'\{\s*key:\s*"{key}"\s*value:\s*\{\s*string_value:\s*"[^"]*"\s*\}\s*\}'


def fill_config(text: str, values: dict[str, str], gpu: bool = True) -> str:
    """``config.pbtxt`` with each ``values`` key set (replaced where present, else added to ``parameters``)
    and, with ``gpu``, the instance on a GPU; everything else as it was."""
    if not re.search(r"^parameters\s*\[", text, flags=re.M):
        raise TrtllmBuildError("config.pbtxt has no `parameters [` block to fill")
    for key, value in values.items():
        entry = f'{{ key: "{key}" value: {{ string_value: "{value}" }} }}'
        pattern = re.compile(_ENTRY.replace("{key}", re.escape(key)))
        if pattern.search(text):
            text = pattern.sub(lambda _: entry, text, count=1)
        else:
            text = re.sub(r"^(parameters\s*\[)", lambda m: f"{m.group(1)}\n  {entry},", text, count=1, flags=re.M)
    if gpu:
        text = re.sub(r"kind:\s*KIND_CPU", "kind: KIND_GPU", text)
    return text


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- running ---------------------------------------------------------------------------------

Runner = Callable[[Step], int]


def run_step(step: Step) -> int:
    """Run one step, its output streamed into the log; returns its exit status."""
    proc = subprocess.Popen(step.argv, env={**os.environ, **dict(step.env)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.info("[%s] %s", step.name, line.rstrip())
        return proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise


def missing_tools() -> list[str]:
    """What this machine lacks to run the build (empty when it can)."""
    missing = []
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        missing.append("the tensorrt_llm Python package")
    if shutil.which("trtllm-build") is None:
        missing.append("trtllm-build on PATH")
    return missing


def tensorrt_llm_version() -> str:
    try:
        import tensorrt_llm

        return str(getattr(tensorrt_llm, "__version__", "unknown"))
    except ImportError:
        return "unknown"


def up_to_date(engine_dir: Path, record: dict) -> bool:
    """The engine in ``engine_dir`` was built with these settings (version aside) and is complete."""
    path = engine_dir / SETTINGS_FILE
    if not path.is_file() or not any(engine_dir.glob("rank*.engine")):
        return False
    try:
        built = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return {k: v for k, v in built.items() if k != "tensorrt_llm_version"} == \
        {k: v for k, v in record.items() if k != "tensorrt_llm_version"}


def build(settings: TrtllmBuildSettings, output: Path, *, force: bool = False, runner: Runner = run_step,
          version: str | None = None) -> Path:
    """Build (or reuse) ``output/trtllm``; returns it. Raises ``TrtllmBuildError`` naming a failed step."""
    final = output / SUBDIR
    record = settings.record(version or tensorrt_llm_version())
    if not force and up_to_date(final, record):
        log.info("%s holds an engine built with these settings; reusing it (--force rebuilds)", final)
        return final
    steps = plan(settings, output)
    for path in (_checkpoint_dir(output), _staging_dir(output)):
        shutil.rmtree(path, ignore_errors=True)
    t0 = time.monotonic()
    try:
        for i, step in enumerate(steps, 1):
            log.info("step %d/%d %s: %s", i, len(steps), step.name, step.shell())
            status = runner(step)
            if status != 0:
                raise TrtllmBuildError(f"step {step.name} failed with exit status {status} (its output is above)")
            log.info("step %d/%d %s done (%.0f s so far)", i, len(steps), step.name, time.monotonic() - t0)
        staging = _staging_dir(output)
        if not any(staging.glob("rank*.engine")):
            raise TrtllmBuildError(f"step build wrote no rank*.engine into {staging}")
        (staging / SETTINGS_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        for path in (_checkpoint_dir(output), _staging_dir(output)):
            shutil.rmtree(path, ignore_errors=True)
    log.info("TensorRT-LLM engine in %s (%.0f s)", final, time.monotonic() - t0)
    return final


# ---- command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prepos_build.trtllm_build",
        description="Build a TensorRT-LLM engine into <engine dir>/trtllm and fill the model repository's config "
                    "to serve it (engine.name trtllm).",
    )
    p.add_argument("--engine-dir", required=True,
                   help="prepos engine directory (from python -m prepos_build) or a Hugging Face causal-LM directory;"
                        " the engine goes into its trtllm/ folder")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--tokens-per-block", type=int, default=16, help="KV block size (power of two; default %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=0, help="default: the engine's context length")
    p.add_argument("--max-input-len", type=int, default=0, help="default: --max-seq-len minus 1")
    p.add_argument("--max-num-tokens", type=int, default=8192, help="tokens one engine step batches")
    p.add_argument("--no-gather-generation-logits", action="store_true",
                   help="leave generation-logit gathering out (then only the logits post-processor can serve)")
    p.add_argument("--model-repository", default="model_repository",
                   help="model repository whose prepos/config.pbtxt is filled (default: %(default)s)")
    p.add_argument("--config-out", help="write the filled config.pbtxt here instead of in place")
    p.add_argument("--no-config", action="store_true", help="build only; leave config.pbtxt alone")
    p.add_argument("--force", action="store_true", help="rebuild even if an engine with these settings exists")
    p.add_argument("--dry-run", action="store_true", help="print every step and command; run and write nothing")
    p.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    return p


def settings_from_args(args: argparse.Namespace) -> TrtllmBuildSettings:
    if args.max_seq_len < 0 or args.max_seq_len == 1:  # 0: the engine's context length
        raise TrtllmBuildError(f"--max-seq-len: must be >= 2 (an input token and the generated one), got "
                               f"{args.max_seq_len}")
    source = Path(args.engine_dir).expanduser().absolute()
    architecture, context = read_source(source, args.max_seq_len)
    max_seq_len = args.max_seq_len or context
    return TrtllmBuildSettings(
        source=str(source), architecture=architecture, dtype=args.dtype, tokens_per_block=args.tokens_per_block,
        max_batch_size=args.max_batch_size, max_seq_len=max_seq_len,
        max_input_len=args.max_input_len or max_seq_len - 1, max_num_tokens=args.max_num_tokens,
        gather_generation_logits=not args.no_gather_generation_logits,
    )


def config_values(engine_dir: Path, model_dir: Path) -> dict[str, str]:
    """The parameters that serve ``engine_dir`` with the trtllm engine (a relative dir where it is below the
    repository's parent, as the shipped config has it)."""
    try:
        shown = os.path.relpath(engine_dir, model_dir)
    except ValueError:  # another drive
        shown = str(engine_dir)
    if shown.startswith("../../../"):
        shown = str(engine_dir)
    return {"engine.name": "trtllm", "engine.device": "cuda", "engine.dir": shown, "engine.scan": "auto"}


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None, runner: Runner = run_step) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGTERM, _terminate)  # clean up the partial build, as on Ctrl-C
    try:
        settings = settings_from_args(args)
        output = Path(settings.source)
        model_dir = Path(args.model_repository).expanduser().absolute() / "prepos"
        config_path = model_dir / "config.pbtxt"
        values = config_values(output, model_dir)
        if not args.no_config and not config_path.is_file():  # a dry run shows what the build would stop at too
            raise TrtllmBuildError(f"--model-repository: {config_path} not found (--no-config builds only)")
        if args.dry_run:
            print(f"# TensorRT-LLM engine for {settings.source} -> {output / SUBDIR}")
            for i, step in enumerate(plan(settings, output), 1):
                print(f"# step {i}: {step.name}")
                print(step.shell())
            print(f"# step 3: write {output / SUBDIR / SETTINGS_FILE} and move the engine into {output / SUBDIR}")
            print(json.dumps(settings.record(tensorrt_llm_version()), indent=2))
            if not args.no_config:
                target = args.config_out or config_path
                print(f"# step 4: fill {target} ({config_path} with these parameters, instance on a GPU)")
                for key, value in values.items():
                    print(f"#   {key} = {value}")
            return 0
        missing = missing_tools()
        if missing:
            raise TrtllmBuildError(f"this machine lacks {' and '.join(missing)}; the build runs in {CONTAINER} "
                                   "(--dry-run prints its commands)")
        engine = build(settings, output, force=args.force, runner=runner)
        if not args.no_config:
            target = Path(args.config_out) if args.config_out else config_path
            _write_atomic(target, fill_config(config_path.read_text(), values))
            log.info("%s now serves %s with engine.name trtllm", target, output)
    except TrtllmBuildError as exc:
        print(f"prepos_build.trtllm_build: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prepos_build.trtllm_build: interrupted; no engine was written", file=sys.stderr)
        return 130
    print(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
