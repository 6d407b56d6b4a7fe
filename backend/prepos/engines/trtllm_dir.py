"""The TensorRT-LLM engine directory, as the trtllm engine reads it.

The prepos engine directory (``prepos_engine.json``, ``tokenizer.json``,
the Hugging Face ``config.json``) holds ``trtllm/`` with the TensorRT-LLM engine
(``rank0.engine`` and ``config.json`` from ``trtllm-build``) and ``trtllm/prepos_trtllm.json``
with the build settings (see :class:`TrtllmBuild`).

Every error names the file and the key at fault (:class:`TrtllmEngineDirError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRTLLM_SUBDIR = "trtllm"
BUILD_FILE = "prepos_trtllm.json"
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}


class TrtllmEngineDirError(ValueError):
    """The TensorRT-LLM engine directory is missing a file or a setting; the message names both."""


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise TrtllmEngineDirError(f"{path}: not found") from None
    except json.JSONDecodeError as err:
        raise TrtllmEngineDirError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise TrtllmEngineDirError(f"{path}: expected a JSON object")
    return data


def _field(path: Path, data: dict, key: str, kind: type, default: Any = ...) -> Any:
    """``data[key]`` checked against ``kind`` (an int must not be a bool); errors name the file and the key."""
    if key not in data or data[key] is None:
        if default is ...:
            raise TrtllmEngineDirError(f"{path}: missing key {key!r}")
        return default
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TrtllmEngineDirError(f"{path}: {key!r} must be {kind.__name__}, got {value!r}")
    return value


_BUILD_KEYS = {"tokens_per_block": int, "max_batch_size": int, "max_seq_len": int, "max_input_len": int,
               "max_num_tokens": int, "dtype": str, "gather_generation_logits": bool}


@dataclass(frozen=True)
class TrtllmBuild:
    """Build settings recorded next to the engine in ``trtllm/prepos_trtllm.json``."""

    tokens_per_block: int
    max_batch_size: int
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int
    dtype: str
    gather_generation_logits: bool

    @classmethod
    def load(cls, path: Path) -> TrtllmBuild:
        data = _read_json(path)
        values = {name: _field(path, data, name, kind) for name, kind in _BUILD_KEYS.items()}
        for name, value in values.items():
            if _BUILD_KEYS[name] is int and value < 1:
                raise TrtllmEngineDirError(f"{path}: {name!r} must be >= 1, got {value}")
        if values["max_input_len"] > values["max_seq_len"]:
            raise TrtllmEngineDirError(f"{path}: 'max_input_len' {values['max_input_len']} exceeds 'max_seq_len' "
                                       f"{values['max_seq_len']}")
        if values["dtype"] not in _DTYPE_BYTES:
            raise TrtllmEngineDirError(f"{path}: 'dtype' {values['dtype']!r} is not one of {sorted(_DTYPE_BYTES)}")
        return cls(**values)


@dataclass(frozen=True)
class TrtllmModel:
    """What the engine needs from the TensorRT-LLM engine's own ``config.json``."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype_bytes: int
    paged_context_fmha: bool  # chunked context needs it

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * self.kv_dtype_bytes

    @classmethod
    def load(cls, path: Path) -> TrtllmModel:
        data = _read_json(path)
        model = _field(path, data, "pretrained_config", dict)
        build = _field(path, data, "build_config", dict, {})
        mapping = model.get("mapping") or {}
        world = int(mapping.get("world_size", 1) or 1)
        if world != 1:
            raise TrtllmEngineDirError(f"{path}: mapping world_size {world}; the trtllm engine runs one GPU (rank0)")
        heads = _field(path, model, "num_attention_heads", int)
        hidden = _field(path, model, "hidden_size", int)
        quant = model.get("quantization") or {}
        kv_algo = str(quant.get("kv_cache_quant_algo") or "").lower()
        dtype = _field(path, model, "dtype", str)
        kv_dtype = kv_algo if kv_algo in ("fp8", "int8") else dtype
        if kv_dtype not in _DTYPE_BYTES:
            raise TrtllmEngineDirError(f"{path}: KV dtype {kv_dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        return cls(
            vocab_size=_field(path, model, "vocab_size", int),
            num_layers=_field(path, model, "num_hidden_layers", int),
            num_kv_heads=_field(path, model, "num_key_value_heads", int, heads),
            head_size=_field(path, model, "head_size", int, hidden // heads),
            kv_dtype_bytes=_DTYPE_BYTES[kv_dtype],
            paged_context_fmha=bool((build.get("plugin_config") or {}).get("use_paged_context_fmha", False)),
        )
