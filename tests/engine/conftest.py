"""Fixtures of the engine tests that more than one module uses."""

from __future__ import annotations

import pytest
from helpers.kept import kept_runner

from plait.engine.model_loader import ResolvedModel
from plait.engine.model_runner import ModelRunner


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory, default_model: ResolvedModel) -> ModelRunner:
    """A runner of the default GGUF in its own format (`--weights auto`) over a cache entry
    without float32 safetensors (helpers/kept.py); one per test module."""
    return kept_runner(tmp_path_factory.mktemp("cache"), default_model)
