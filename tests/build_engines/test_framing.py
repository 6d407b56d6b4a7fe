"""Chat framing derived from tokenizers' chat templates."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import prepos_build  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "build_engines"))

from prepos_build.framing import (  # noqa: E402
    SAMPLE_TEXTS,
    FramingError,
    compose,
    derive_framing,
    framing_texts,
    render_with_framing,
)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
)


def llama3_like(header_end: str) -> str:
    return (
        "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role']"
        " + '<|end_header_id|>" + header_end + "' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>" + header_end + "' }}{% endif %}"
    )


@pytest.fixture()
def smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir), local_files_only=True)


@pytest.fixture(scope="module")
def tiny_bpe():
    """A small byte-level BPE tokenizer trained on the spot, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = list(SAMPLE_TEXTS) * 4 + ["system user assistant tool", "Hello world, how are you today?"]
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|im_start|>", unk_token="<|endoftext|>"
    )
    tok.chat_template = CHATML
    return tok


def _render(tok, messages, gen):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def _enc(tok, text):
    return list(tok.encode(text, add_special_tokens=False))


# --- SmolLM2 -------------------------------------------------------------------------------------


def test_smollm2_exact_pieces(smollm2):
    f = derive_framing(smollm2)
    assert set(f) == {
        "roles",
        "close_text",
        "close_ids",
        "cue_text",
        "cue_ids",
        "answer_terminator_text",
        "answer_terminator_ids",
        "default_system_text",
        "default_system_ids",
        "stop_token_ids",
    }
    assert {r: v["entry_text"] for r, v in f["roles"].items()} == {
        "system": "<|im_start|>system\n",
        "user": "<|im_start|>user\n",
        "tool": "<|im_start|>tool\n",
    }
    assert f["close_text"] == "<|im_end|>\n"
    assert f["cue_text"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert f["answer_terminator_text"] == "<|im_end|>\n"
    assert f["default_system_text"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    )
    im_start, im_end = smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert f["roles"]["user"]["entry_ids"][0] == im_start
    assert f["close_ids"][0] == im_end
    assert f["stop_token_ids"] == [im_end]  # eos is <|im_end|> too: deduplicated
    for role in f["roles"].values():
        assert role["entry_ids"] == _enc(smollm2, role["entry_text"])
    for key in ("close", "cue", "answer_terminator", "default_system"):
        assert f[f"{key}_ids"] == _enc(smollm2, f[f"{key}_text"])


def test_smollm2_invariants(smollm2):
    f = derive_framing(smollm2)
    e = {r: v["entry_text"] for r, v in f["roles"].items()}
    close, cue, term, dflt = f["close_text"], f["cue_text"], f["answer_terminator_text"], f["default_system_text"]
    s, u, a, u2 = "Be brief", "Hello there", "Hi how can I help", "Tell me a joke"

    got = _render(smollm2, [{"role": "system", "content": s}, {"role": "user", "content": u}], True)
    assert got == e["system"] + s + close + e["user"] + u + cue

    conv = [{"role": "user", "content": u}, {"role": "assistant", "content": a}, {"role": "user", "content": u2}]
    assert _render(smollm2, conv, False) == dflt + e["user"] + u + cue + a + term + e["user"] + u2 + close
    assert _render(smollm2, conv, True) == dflt + e["user"] + u + cue + a + term + e["user"] + u2 + cue

    # Token level: the pieces tokenized one by one are the rendered text tokenized whole.
    for i, text in enumerate(SAMPLE_TEXTS):
        other = SAMPLE_TEXTS[(i + 1) % len(SAMPLE_TEXTS)]
        msgs = [
            {"role": "system", "content": other},
            {"role": "user", "content": text},
            {"role": "assistant", "content": other},
            {"role": "tool", "content": text},
        ]
        whole = _enc(smollm2, _render(smollm2, msgs, True))
        pieces = (
            f["roles"]["system"]["entry_ids"] + _enc(smollm2, other) + f["close_ids"]
            + f["roles"]["user"]["entry_ids"] + _enc(smollm2, text) + f["cue_ids"]
            + _enc(smollm2, other) + f["answer_terminator_ids"]
            + f["roles"]["tool"]["entry_ids"] + _enc(smollm2, text) + f["cue_ids"]
        )  # fmt: skip
        assert pieces == whole


def test_render_with_framing_matches_template(smollm2):
    f = derive_framing(smollm2)
    conv = [
        {"role": "user", "content": "What is two plus two"},
        {"role": "assistant", "content": "It is four"},
        {"role": "tool", "content": "calculator says four"},
        {"role": "assistant", "content": "Confirmed"},
        {"role": "user", "content": "Thanks a lot"},
    ]
    for gen in (False, True):
        assert render_with_framing(f, conv, gen) == _render(smollm2, conv, gen)
    kinds = [k for k, _ in compose(framing_texts(f), conv, True)]
    assert kinds[:3] == ["frame", "frame", "content"]


# --- other templates -----------------------------------------------------------------------------


def test_zephyr_template_not_smollm2_specific(smollm2, caplog):
    smollm2.chat_template = ZEPHYR
    with caplog.at_level(logging.WARNING, logger="prepos_build.framing"):
        f = derive_framing(smollm2)
    eos = smollm2.eos_token
    assert {r: v["entry_text"] for r, v in f["roles"].items()} == {"system": "<|system|>\n", "user": "<|user|>\n"}
    assert f["close_text"] == eos + "\n"
    assert f["cue_text"] == eos + "\n<|assistant|>\n"
    assert f["answer_terminator_text"] == eos + "\n"
    assert f["default_system_text"] == "" and f["default_system_ids"] == []
    assert f["stop_token_ids"] == [smollm2.eos_token_id]
    assert "tool" in caplog.text  # the template drops tool messages: role left out, with a warning


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_llama3_like_template(smollm2):
    smollm2.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    smollm2.chat_template = llama3_like("\n")
    f = derive_framing(smollm2)
    assert f["default_system_text"] == "<|begin_of_text|>"
    assert f["roles"]["system"]["entry_text"] == "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
    assert f["roles"]["user"]["entry_text"] == "<|start_header_id|>user<|end_header_id|>\n"
    assert f["roles"]["tool"]["entry_text"] == "<|start_header_id|>tool<|end_header_id|>\n"
    assert f["close_text"] == "<|eot_id|>"
    assert f["cue_text"] == "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
    assert f["answer_terminator_text"] == "<|eot_id|>"
    assert f["answer_terminator_ids"] == [smollm2.convert_tokens_to_ids("<|eot_id|>")]
    assert f["stop_token_ids"] == [smollm2.eos_token_id, smollm2.convert_tokens_to_ids("<|eot_id|>")]


def test_plain_text_markers_merging_across_pieces_are_reported(smollm2):
    # Without the Llama-3 markers as special tokens, "|>" + "<|" of adjacent pieces merges into one token.
    smollm2.chat_template = llama3_like("\n")
    with pytest.raises(FramingError, match="tokenizing the framing pieces separately differs"):
        derive_framing(smollm2)


def test_token_mismatch_is_reported(smollm2, caplog):
    # SmolLM2's pre-tokenizer splits "\n\nHello" as "\n" + "\nHello", unlike "\n\n" + "Hello".
    smollm2.add_tokens(LLAMA3_SPECIALS, special_tokens=True)
    smollm2.chat_template = llama3_like("\n\n")
    with pytest.raises(FramingError, match="tokenizing the framing pieces separately differs"):
        derive_framing(smollm2)
    with caplog.at_level(logging.WARNING, logger="prepos_build.framing"):
        f = derive_framing(smollm2, strict_tokens=False)
    assert f["close_text"] == "<|eot_id|>"
    assert "differs" in caplog.text


def test_tiny_trained_tokenizer(tiny_bpe):
    f = derive_framing(tiny_bpe)
    assert f["roles"]["user"]["entry_text"] == "<|im_start|>user\n"
    assert f["cue_text"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert f["default_system_text"] == ""
    eos, im_end = tiny_bpe.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert f["stop_token_ids"] == [eos, im_end]


# --- templates that cannot be framed -------------------------------------------------------------


def test_no_chat_template(tiny_bpe):
    tiny_bpe.chat_template = None
    try:
        with pytest.raises(FramingError, match="no chat template"):
            derive_framing(tiny_bpe)
    finally:
        tiny_bpe.chat_template = CHATML


@pytest.mark.parametrize(
    "template, message",
    [
        pytest.param(
            CHATML.replace("message['content']", "message['content'] | upper"),
            "verbatim",
            id="content-transformed",
        ),
        pytest.param(
            "{% for message in messages %}{% if message['role'] == 'system' %}"
            "{{ raise_exception('system messages are not supported') }}{% endif %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
            "failed to render",
            id="system-rejected",
        ),
        pytest.param(
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
            " + '<|im_end|>\n' }}{% endfor %}",
            "ignores add_generation_prompt",
            id="no-generation-prompt",
        ),
        pytest.param(
            CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"),
            "differs from the generation prompt cue",
            id="history-answer-unlike-generation",
        ),
        pytest.param(
            "{% for message in messages %}{% if loop.last %}{{ '[' + message['role'] + '] ' + message['content'] + '\n' }}"
            "{% else %}{{ '<' + message['role'] + '> ' + message['content'] + '\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}",
            r"\[user, assistant, user\] starts with",
            id="last-turn-special",
        ),
    ],
)
def test_unframeable_templates_raise(tiny_bpe, template, message):
    tiny_bpe.chat_template = template
    try:
        with pytest.raises(FramingError, match=message):
            derive_framing(tiny_bpe)
    finally:
        tiny_bpe.chat_template = CHATML
