"""Tiny random Llama checkpoints (tied and untied embeddings) shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _make_checkpoint(path, *, tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    # Default init gives near-uniform logits; widen them so mismatches cannot hide in noise.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tied")
    return str(path), _make_checkpoint(path, tie=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-untied")
    return str(path), _make_checkpoint(path, tie=False)
