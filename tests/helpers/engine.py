"""Helpers for engine tests with a tiny model (test_scheduler_*.py, test_engine_*.py).

    GREEDY, EOS                      greedy 8-token params; tiny_model's eos_token_id
    prompt(seed, length)             random token ids
    make_llm(path, **options)        LLM with 64 blocks of 4 unless overridden
    alone(path, ids, params)         the request run by itself, without prefix caching
    run_until_done(llm)              step to the end: request id -> deltas
    tokens_of(deltas)                the token ids of those deltas
    assert_all_free(pool)            no block in use
    assert_pool_clean(llm)           at rest: no block in use, the usage gauge reads 0
"""

from __future__ import annotations

import random

from plait import LLM, SamplingParams
from plait.engine.block_pool import BlockPool

EOS = 2  # tiny_model's eos_token_id
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(length)]


def make_llm(path, **options) -> LLM:
    defaults = dict(num_kv_blocks=64, block_size=4)
    defaults.update(options)
    return LLM(str(path), **defaults)


_ALONE: dict[str, LLM] = {}  # one LLM per checkpoint path


def alone(path, token_ids: list[int], params: SamplingParams):
    """This request run by itself, with prefix caching (and so prompt sharing) off."""
    if str(path) not in _ALONE:
        _ALONE[str(path)] = make_llm(path, enable_prefix_caching=False)
    return _ALONE[str(path)].generate([token_ids], params)[0].outputs[0]


def run_until_done(llm: LLM) -> dict[str, list]:
    """Step the engine to the end; request id -> its deltas."""
    seen: dict[str, list] = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    return seen


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks


def assert_pool_clean(llm: LLM) -> None:
    """At rest every block is free (kept prompts name cached blocks, they hold none)."""
    assert llm.stats().kv_blocks_used == 0
    assert_all_free(llm.engine.pool)
