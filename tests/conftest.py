"""Shared fixtures: the embedded default model (converted once per cache), its tokenizer, a
tiny random-weight Llama on that tokenizer, and a one-torch-thread switch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.server import RemoteServer, shared_server
from helpers.tiny_model import make_tiny_model

from plait._paths import drop_checkout_root
from plait.engine.model_loader import ResolvedModel, load_tokenizer, resolve_model

# `python -m pytest` from the repository root puts it on sys.path, where kernels/ would hide
# the PyPI package `kernels` that transformers imports (plait/_paths.py).
drop_checkout_root()


@pytest.fixture(scope="session")
def default_model() -> ResolvedModel:
    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(default_model: ResolvedModel):
    return load_tokenizer(default_model.path)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory, default_model: ResolvedModel) -> Path:
    """A tiny random-weight Llama (seed 0) with the default model's tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), default_model.path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: thread hand-offs cost more than they save, worse on a busy machine.
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server() -> RemoteServer:
    """The session's real `plait serve` on the default model (server_harness.shared_server),
    for the modules that test against it; a module that needs another server defines its
    own `server` fixture, which overrides this one."""
    return shared_server()


@pytest.fixture(scope="module")
def http(server: RemoteServer):
    """An HTTP client for `server`, with its API key."""
    with server.http() as client:
        yield client
