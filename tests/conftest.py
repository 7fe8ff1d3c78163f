"""Shared fixtures: the embedded default model (converted once per cache) and its tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test helpers: tiny_model, server_harness

from plait.engine.model_loader import ResolvedModel, load_tokenizer, resolve_model


@pytest.fixture(scope="session")
def default_model() -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model: ResolvedModel):
    return load_tokenizer(default_model.path)
