"""The runner's thread policy: small (decode) steps on fewer torch threads, large steps on
all of them, overridable by PLAIT_DECODE_THREADS (0 = off)."""

from __future__ import annotations

import torch

from plait.engine.model_runner import ThreadPolicy


def test_small_steps_use_fewer_threads_and_large_steps_all(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("PLAIT_DECODE_THREADS", raising=False)
        policy = ThreadPolicy(torch.device("cpu"))
        assert (policy.full, policy.small) == (2, 1)
        policy.enter(16, 16)
        assert torch.get_num_threads() == 1
        policy.enter(0, 100)  # sampling 100 kept rows is vocabulary-wide work
        assert torch.get_num_threads() == 2
        policy.enter(16, 16)
        policy.enter(512, 1)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("PLAIT_DECODE_THREADS", "0")
        off = ThreadPolicy(torch.device("cpu"))
        off.enter(1, 1)
        assert off.small is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
