"""The TensorRT-LLM build: its commands, validation, reuse, the filled config, and its dry run (CPU only)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from prepos.config import read_config
from prepos_build import trtllm_build as tb

REPO = Path(__file__).resolve().parents[2]
needs_trtllm = pytest.mark.skipif(bool(tb.missing_tools()),
                                  reason="needs TensorRT-LLM (NVIDIA's Triton TensorRT-LLM container)")


def _checkpoint(tmp_path: Path, architecture="LlamaForCausalLM", max_context=2048) -> Path:
    d = tmp_path / "engine"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [architecture], "max_position_embeddings": 8192}))
    (d / "prepos_engine.json").write_text(json.dumps({"max_context": max_context}))
    return d


def _settings(tmp_path, **kw) -> tb.TrtllmBuildSettings:
    args = tb._parser().parse_args(["--engine-dir", str(_checkpoint(tmp_path)), *kw.pop("argv", [])])
    return tb.settings_from_args(args)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_the_build_command_carries_every_setting_the_contract_needs(tmp_path):
    s = _settings(tmp_path, argv=["--tokens-per-block", "8", "--max-batch-size", "32", "--dtype", "float16"])
    convert, build = tb.plan(s, Path(s.source))
    assert convert.name == "convert" and "LLaMAForCausalLM" in convert.argv[-1]
    assert "dtype='float16'" in convert.argv[-1] and f"save_checkpoint({str(tb._checkpoint_dir(Path(s.source)))!r})" \
        in convert.argv[-1]
    argv = list(build.argv)
    assert argv[0] == "trtllm-build"
    assert _flag(argv, "--checkpoint_dir") == str(tb._checkpoint_dir(Path(s.source)))
    assert _flag(argv, "--kv_cache_type") == "paged"
    assert _flag(argv, "--use_paged_context_fmha") == "enable"
    assert "--gather_generation_logits" in argv
    assert _flag(argv, "--tokens_per_block") == "8"
    assert _flag(argv, "--max_batch_size") == "32"
    # the context length comes from the prepos manifest; the input leaves room for the generated token
    assert (_flag(argv, "--max_seq_len"), _flag(argv, "--max_input_len")) == ("2048", "2047")


def test_without_generation_logits_the_flag_is_left_out(tmp_path):
    s = _settings(tmp_path, argv=["--no-gather-generation-logits"])
    assert "--gather_generation_logits" not in tb.plan(s, Path(s.source))[1].argv


@pytest.mark.parametrize("argv, arg", [
    (["--tokens-per-block", "24"], "--tokens-per-block"),
    (["--tokens-per-block", "1024"], "--tokens-per-block"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--max-seq-len", "100", "--max-input-len", "100"], "--max-input-len"),
])
def test_bad_sizes_name_the_argument(tmp_path, argv, arg):
    with pytest.raises(tb.TrtllmBuildError, match=f"^{arg}: "):
        _settings(tmp_path, argv=argv)


def test_an_unsupported_architecture_or_a_missing_config_names_the_engine_dir(tmp_path):
    """The errors named --source, a flag this command does not have."""
    d = _checkpoint(tmp_path, architecture="GPT2LMHeadModel")
    with pytest.raises(tb.TrtllmBuildError, match="^--engine-dir: architecture 'GPT2LMHeadModel'"):
        tb.settings_from_args(tb._parser().parse_args(["--engine-dir", str(d)]))
    with pytest.raises(tb.TrtllmBuildError, match="^--engine-dir: .*config.json not found"):
        tb.read_source(tmp_path / "nowhere")


@pytest.mark.parametrize(("config", "problem"), [
    ("{not json", r"^--engine-dir: cannot read .*config.json as JSON"),
    ("[1, 2]", r"^--engine-dir: .*config.json holds list, not a JSON object$"),
    ('{"architectures": 5}', r"architectures must be a list of class names, got 5$"),
    ('{"architectures": "LlamaForCausalLM"}', r'architectures must be a list of class names, got "LlamaForCausalLM"$'),
    ('{"architectures": ["LlamaForCausalLM"], "max_position_embeddings": "lots"}', "not a number"),
])
def test_a_config_that_is_not_a_models_is_refused_naming_the_engine_dir(tmp_path, capsys, config, problem):
    """They were tracebacks (JSONDecodeError, AttributeError), exit 1."""
    d = _checkpoint(tmp_path)
    (d / "prepos_engine.json").unlink()
    (d / "config.json").write_text(config)
    with pytest.raises(tb.TrtllmBuildError, match=problem):
        tb.read_source(d)
    assert tb.main(["--engine-dir", str(d), "--no-config", "--dry-run"]) == 2
    assert "prepos_build.trtllm_build: error: --engine-dir: " in capsys.readouterr().err


def test_max_seq_len_stands_in_for_a_context_length_the_checkpoint_does_not_give(tmp_path, capsys):
    """The error said "pass --max-seq-len", and passing it gave the same error; a bad one blamed --max-input-len."""
    d = _checkpoint(tmp_path)
    (d / "prepos_engine.json").unlink()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert tb.main(["--engine-dir", str(d), "--no-config", "--dry-run"]) == 2
    assert "gives no context length; pass --max-seq-len" in capsys.readouterr().err
    assert tb.main(["--engine-dir", str(d), "--no-config", "--dry-run", "--max-seq-len", "1024"]) == 0
    assert "--max_seq_len 1024" in capsys.readouterr().out
    for bad in ("-5", "1"):
        assert tb.main(["--engine-dir", str(d), "--no-config", "--dry-run", "--max-seq-len", bad]) == 2
        assert f"error: --max-seq-len: must be >= 2 (an input token and the generated one), got {bad}" in \
            capsys.readouterr().err


def test_a_dry_run_stops_where_the_build_would_at_a_repository_without_the_config(tmp_path, capsys):
    d = _checkpoint(tmp_path)
    assert tb.main(["--engine-dir", str(d), "--model-repository", str(tmp_path / "nowhere"), "--dry-run"]) == 2
    assert f"--model-repository: {tmp_path / 'nowhere' / 'prepos' / 'config.pbtxt'} not found" in \
        capsys.readouterr().err


def _fake_runner(calls, fail_at=None):
    def run(step):
        calls.append(step.name)
        if step.name == fail_at:
            return 1
        if step.name == "build":
            out = Path(step.argv[step.argv.index("--output_dir") + 1])
            out.mkdir(parents=True)
            (out / "rank0.engine").write_bytes(b"engine")
            (out / "config.json").write_text("{}")
        return 0
    return run


def test_a_build_records_its_settings_and_an_equal_build_is_reused(tmp_path):
    s = _settings(tmp_path)
    out, calls = Path(s.source), []
    engine = tb.build(s, out, runner=_fake_runner(calls), version="9.9")
    assert calls == ["convert", "build"] and (engine / "rank0.engine").is_file()
    recorded = json.loads((engine / tb.SETTINGS_FILE).read_text())
    assert recorded["tokens_per_block"] == 16 and recorded["gather_generation_logits"] is True
    assert recorded["tensorrt_llm_version"] == "9.9"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # staging cleaned up
    tb.build(s, out, runner=_fake_runner(calls), version="9.9")
    assert calls == ["convert", "build"]  # reused
    tb.build(s, out, runner=_fake_runner(calls), version="9.9", force=True)
    assert calls == ["convert", "build"] * 2
    other = tb.TrtllmBuildSettings(**{**tb.dataclasses.asdict(s), "tokens_per_block": 32})
    tb.build(other, out, runner=_fake_runner(calls), version="9.9")
    assert len(calls) == 6  # different settings: rebuilt


def test_the_engine_adapter_reads_what_the_build_records(tmp_path):
    from prepos.engines.trtllm_dir import TrtllmBuild

    s = _settings(tmp_path)
    engine = tb.build(s, Path(s.source), runner=_fake_runner([]), version="9.9")
    read = TrtllmBuild.load(engine / tb.SETTINGS_FILE)
    assert (read.tokens_per_block, read.max_seq_len, read.max_input_len, read.gather_generation_logits) == \
        (16, 2048, 2047, True)


def test_a_failed_step_leaves_the_previous_engine_and_no_staging(tmp_path):
    s = _settings(tmp_path)
    out = Path(s.source)
    tb.build(s, out, runner=_fake_runner([]), version="1")
    with pytest.raises(tb.TrtllmBuildError, match="step build failed with exit status 1"):
        tb.build(s, out, runner=_fake_runner([], fail_at="build"), version="1", force=True)
    assert (out / tb.SUBDIR / "rank0.engine").is_file()
    assert not tb._staging_dir(out).exists() and not tb._checkpoint_dir(out).exists()


def _parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))


def test_the_filled_config_serves_the_engine_and_keeps_everything_else():
    source = (REPO / "model_repository" / "prepos" / "config.pbtxt").read_text()
    before = _parameters(source)
    values = {"engine.name": "trtllm", "engine.device": "cuda", "engine.dir": "/e/x", "engine.scan": "auto"}
    filled = tb.fill_config(source, values)
    after = _parameters(filled)
    assert after == {**before, **values}
    config = read_config(after, environ={})
    assert (config.engine.name, config.engine.device, config.engine.dir) == ("trtllm", "cuda", "/e/x")
    assert "KIND_GPU" in filled and "KIND_CPU" not in filled
    # everything outside the parameters and the instance kind is unchanged
    def strip(text):
        return re.sub(r"parameters \[.*\]", "", text, flags=re.S).replace("KIND_GPU", "KIND_CPU")

    assert strip(filled) == strip(source)
    assert tb.fill_config(filled, values) == filled  # idempotent


def test_dry_run_prints_the_commands_and_writes_nothing(tmp_path, capsys):
    d = _checkpoint(tmp_path)
    repo = tmp_path / "repo" / "prepos"
    repo.mkdir(parents=True)
    config = (REPO / "model_repository" / "prepos" / "config.pbtxt").read_text()
    (repo / "config.pbtxt").write_text(config)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert tb.main(["--engine-dir", str(d), "--model-repository", str(tmp_path / "repo"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "trtllm-build --checkpoint_dir" in out and "--gather_generation_logits" in out
    assert "from_hugging_face" in out and "engine.name = trtllm" in out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (repo / "config.pbtxt").read_text() == config


@pytest.mark.skipif(tb.missing_tools() == [], reason="TensorRT-LLM is installed here")
def test_without_tensorrt_llm_the_build_stops_with_a_clear_error(tmp_path, capsys):
    d = _checkpoint(tmp_path)
    assert tb.main(["--engine-dir", str(d), "--no-config"]) == 2
    err = capsys.readouterr().err
    assert "tensorrt_llm" in err and "NVIDIA's Triton TensorRT-LLM container" in err and "Traceback" not in err
    assert not (d / tb.SUBDIR).exists()


@needs_trtllm
def test_a_real_build_of_the_default_model(tmp_path):
    """Builds the default engine's checkpoint for real and checks the engine config the adapter reads."""
    from prepos.engines.trtllm_dir import TrtllmModel

    src = REPO / "engines" / "smollm2-135m-instruct"
    if not (src / "config.json").is_file():
        pytest.skip("the default engine is not built (make engine)")
    work = tmp_path / "engine"
    work.mkdir()
    for name in ("config.json", "model.safetensors", "prepos_engine.json", "tokenizer.json", "tokenizer_config.json"):
        (work / name).symlink_to(src / name)
    assert tb.main(["--engine-dir", str(work), "--no-config", "--max-seq-len", "2048"]) == 0
    model = TrtllmModel.load(work / tb.SUBDIR / "config.json")
    assert model.paged_context_fmha and model.vocab_size >= 49152
