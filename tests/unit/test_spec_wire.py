"""Speculative decoding across the engine-process pipe (engine/wire.py): the config reaches
the engine process whole, and the spec_decode counters come back in EngineStats."""

from __future__ import annotations

from plait.engine import wire
from plait.engine.config import EngineConfig
from plait.engine.core_api import EngineStats
from plait.engine.spec.config import SpeculativeConfig


def test_config_and_counters_cross_the_pipe() -> None:
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                   '"prompt_lookup_min": 2, "disable_by_batch_size": 6}')
    config = EngineConfig(speculative_config=spec)
    assert wire.decode_start(wire.encode(wire.EngineStart(config=config))).config == config
    stats = EngineStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=12,
                        spec_decode_num_accepted_tokens=7,
                        spec_decode_accepted_per_pos=(4, 2, 1))
    event = wire.OutputsEvent([], stats)
    assert wire.decode_event(wire.encode(event)).stats == stats
