"""Tiny random Llama checkpoints (tied and untied embeddings) shared by the engine tests."""

from __future__ import annotations

import pytest

from fakes import write_tiny_llama


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tied")
    return str(path), write_tiny_llama(path, tie=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-untied")
    return str(path), write_tiny_llama(path, tie=False)
