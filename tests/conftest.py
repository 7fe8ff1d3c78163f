"""Shared fixtures: the embedded default model (converted once per cache) and its tokenizer."""

from __future__ import annotations

import pytest

from plait.engine.model_loader import ResolvedModel, load_tokenizer, resolve_model


@pytest.fixture(scope="session")
def default_model() -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model: ResolvedModel):
    return load_tokenizer(default_model.path)
