"""The engine driver for tests with a tiny model (tests/engine/, tests/unit/).

    GREEDY, EOS                      greedy 8-token params; tiny_model's eos_token_id
    SHARING                          LLM options of the prompt-sharing tests (blocks of 16)
    prompt(seed, length)             random token ids
    make_llm(path, **options)        LLM with 64 blocks of 4 unless overridden
    solo(path, ids, params, **opts)  the request run by itself, without prefix caching
    run_until_done(llm)              step to the end: a Run (request id -> deltas)
    tokens_of(deltas)                the token ids of those deltas
    assert_all_free(pool)            no block in use
    assert_pool_clean(llm)           at rest: no block in use, the usage gauge reads 0

The model itself, driven over a hand-written paged cache, is tests/helpers/model.py.
"""

from __future__ import annotations

import random

from plait import LLM, SamplingParams
from plait.engine.block_pool import BlockPool
from plait.engine.outputs import RequestDelta, RequestOutput

EOS = 2  # tiny_model's eos_token_id
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Prompt sharing: 60-token prompts are 3 full blocks and a partial one, and a step computes
# several of them.
SHARING = dict(num_kv_blocks=256, block_size=16, max_num_batched_tokens=512)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(length)]


def make_llm(path, **options) -> LLM:
    defaults = dict(num_kv_blocks=64, block_size=4)
    defaults.update(options)
    return LLM(str(path), **defaults)


_SOLO: dict[tuple, LLM] = {}  # one LLM per (checkpoint, options), kept for the session


def solo(path, token_ids: list[int], params: SamplingParams, **options) -> RequestOutput:
    """This request run by itself (no batch, no preemption) on an LLM built by
    `make_llm(path, **options)` with prefix caching, and so prompt sharing, off."""
    key = (str(path), tuple(sorted(options.items())))
    if key not in _SOLO:
        _SOLO[key] = make_llm(path, **options, enable_prefix_caching=False)
    return _SOLO[key].generate([token_ids], params)[0]


def solo_tokens(path, token_ids: list[int], params: SamplingParams, **options) -> list[int]:
    """The token ids of `solo(...)`'s one choice."""
    return solo(path, token_ids, params, **options).outputs[0].token_ids


class Run(dict[str, list[RequestDelta]]):
    """What `run_until_done` saw: request id -> its deltas in order, and in `first_step`
    request id -> the index of the step that gave its first delta."""

    def __init__(self) -> None:
        super().__init__()
        self.first_step: dict[str, int] = {}


def run_until_done(llm: LLM) -> Run:
    """Step the engine until no request is left."""
    seen = Run()
    step = 0
    while llm.engine.has_unfinished():
        for delta in llm.engine.step().deltas:
            seen.setdefault(delta.request_id, []).append(delta)
            seen.first_step.setdefault(delta.request_id, step)
        step += 1
    return seen


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks


def assert_pool_clean(llm: LLM) -> None:
    """At rest every block is free (kept prompts name cached blocks, they hold none)."""
    assert llm.stats().kv_blocks_used == 0
    assert_all_free(llm.engine.pool)
