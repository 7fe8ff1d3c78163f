"""Sampler: processors change exactly the right logits, masks keep exactly the right tokens,
draws follow the masked distribution, seeded rows are reproducible, logprobs are exact."""

from __future__ import annotations

import math

import pytest
import torch

from plait.engine.sampler import (
    Sampler,
    SamplingMetadata,
    _inverse_cdf,
    apply_penalties,
    mask_logits,
    process_logits,
)
from plait.engine.sampling_params import SamplingParams

EOS = 2


def make_meta(params: list[SamplingParams], *, generators=None, prompt_token_ids=None,
              output_token_ids=None) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata(
        params=params,
        generators=generators or [None] * num_rows,
        prompt_token_ids=prompt_token_ids or [[] for _ in range(num_rows)],
        output_token_ids=output_token_ids or [[] for _ in range(num_rows)],
        eos_token_ids=(EOS,),
    )


def seeded(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def token_frequencies(logits_row: torch.Tensor, params: SamplingParams,
                      num_draws: int = 20000) -> torch.Tensor:
    """Empirical distribution of `num_draws` samples of one row (one batched call)."""
    logits = logits_row.unsqueeze(0).repeat(num_draws, 1)
    out = Sampler(seed=1)(logits, make_meta([params] * num_draws))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[0])
    return counts.float() / num_draws


# Probabilities 0.1..0.4 in a shuffled order, so masks must scatter back to the right ids.
PROBS = torch.tensor([0.2, 0.4, 0.1, 0.3])
LOG_PROBS = PROBS.log()


# --- greedy --------------------------------------------------------------------------------

def test_greedy_rows_take_argmax_even_next_to_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = Sampler()(logits, make_meta(params))
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]
    assert out.logprobs == [None] * 6


def test_sampler_does_not_modify_input_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    before = logits.clone()
    params = SamplingParams(temperature=0.7, logit_bias={0: 5.0}, repetition_penalty=2.0,
                            top_k=2, min_tokens=1)
    Sampler()(logits, make_meta([params], prompt_token_ids=[[1]]))
    assert torch.equal(logits, before)


# --- masks (pure function) -----------------------------------------------------------------

def masked_probs(top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    out = mask_logits(LOG_PROBS.unsqueeze(0), torch.tensor([top_k]), torch.tensor([top_p]),
                      torch.tensor([min_p]))
    return out.softmax(dim=-1)[0]


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, [0.2, 0.4, 0.1, 0.3]),
    ({"top_k": 2}, [0.0, 4 / 7, 0.0, 3 / 7]),
    ({"top_k": 10}, [0.2, 0.4, 0.1, 0.3]),
    ({"top_p": 0.6}, [0.0, 4 / 7, 0.0, 3 / 7]),             # 0.4 < 0.6 <= 0.4 + 0.3
    ({"top_p": 0.75}, [2 / 9, 4 / 9, 0.0, 3 / 9]),          # 0.7 < 0.75 <= 0.9
    ({"top_p": 0.3}, [0.0, 1.0, 0.0, 0.0]),                 # the top token alone suffices
    ({"top_k": 3, "top_p": 0.75}, [0.0, 4 / 7, 0.0, 3 / 7]),  # top-p sees renormalised top-3
    ({"min_p": 0.6}, [0.0, 4 / 7, 0.0, 3 / 7]),             # keep p >= 0.24
    ({"min_p": 0.3}, [2 / 9, 4 / 9, 0.0, 3 / 9]),           # keep p >= 0.12
    ({"top_k": 3, "min_p": 0.6}, [0.0, 4 / 7, 0.0, 3 / 7]),
])
def test_mask_keeps_exact_tokens_and_renormalises(kwargs, expected):
    torch.testing.assert_close(masked_probs(**kwargs), torch.tensor(expected))


def test_mask_rows_are_independent():
    logits = LOG_PROBS.repeat(3, 1)
    out = mask_logits(logits, torch.tensor([1, 0, 0]), torch.tensor([1.0, 0.6, 1.0]),
                      torch.tensor([0.0, 0.0, 0.0]))
    assert torch.isinf(out).tolist() == [
        [True, False, True, True], [True, False, True, False], [False, False, False, False]]
    assert torch.equal(out[2], logits[2])


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(temperature=1.0), [0.2, 0.4, 0.1, 0.3]),
    (SamplingParams(temperature=1.0, top_k=2), [0.0, 4 / 7, 0.0, 3 / 7]),
    (SamplingParams(temperature=1.0, top_p=0.75), [2 / 9, 4 / 9, 0.0, 3 / 9]),
    (SamplingParams(temperature=1.0, min_p=0.6), [0.0, 4 / 7, 0.0, 3 / 7]),
    # temperature 0.5 squares the probabilities: [4, 16, 1, 9] / 30
    (SamplingParams(temperature=0.5), [4 / 30, 16 / 30, 1 / 30, 9 / 30]),
    (SamplingParams(temperature=2.0, top_k=2), [0.0, 2 / (2 + math.sqrt(3)),
                                                0.0, math.sqrt(3) / (2 + math.sqrt(3))]),
])
def test_draws_follow_the_masked_distribution(params, expected):
    freqs = token_frequencies(LOG_PROBS, params)
    expected_t = torch.tensor(expected)
    assert torch.equal(freqs == 0, expected_t == 0)  # masked tokens are never drawn
    torch.testing.assert_close(freqs, expected_t, atol=0.015, rtol=0)


def test_draws_pass_a_chi_square_test_on_a_wide_vocabulary():
    # 400 tokens with random (very uneven) probabilities, 40000 draws, fixed seeds: the
    # chi-square statistic over the tokens expected >= 5 times stays under the 0.999
    # quantile (~ dof + 3.1 sqrt(2 dof)), which a sampler off by one token would blow up.
    logits = torch.randn(400, generator=seeded(11)) * 2.0
    probs = logits.softmax(-1)
    num_draws = 40000
    freqs = token_frequencies(logits, SamplingParams(temperature=1.0), num_draws)
    expected = probs * num_draws
    keep = expected >= 5
    observed = freqs * num_draws
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 3.1 * math.sqrt(2 * dof), (chi2, dof)


def test_inverse_cdf_picks_the_interval_of_u_and_never_a_zero_weight_token():
    logits = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).log().repeat(6, 1)  # token 1 weight 0
    u = torch.tensor([[0.0], [0.1999], [0.2001], [0.6999], [0.7001], [1.0]])
    assert _inverse_cdf(logits, u).tolist() == [0, 0, 2, 2, 3, 3]  # u = 1 overshoots: last


def test_a_seeded_row_draws_one_uniform_per_step():
    generator = seeded(5)
    Sampler()(torch.randn(1, 1000), make_meta([SamplingParams(seed=5)], generators=[generator]))
    replay = seeded(5)
    replay.set_state(seeded(5).get_state())
    torch.rand(1, generator=replay)
    assert torch.equal(generator.get_state(), replay.get_state())


# --- logit processors ----------------------------------------------------------------------

def test_penalties_change_exactly_the_right_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 3.0, 0.0],
                           [2.0, -1.0, 0.5, -2.0, 3.0, 0.0]])
    out = apply_penalties(
        logits.clone(), prompt_token_ids=[[0, 1], [4]], output_token_ids=[[2, 2, 3], [4, 4]],
        repetition_penalties=torch.tensor([2.0, 1.0]),
        presence_penalties=torch.tensor([0.5, 0.0]),
        frequency_penalties=torch.tensor([0.25, -1.0]))
    # Row 0: prompt-only tokens 0, 1 get repetition only (3.0 / 2, -1.0 * 2); output tokens
    # 2 (twice) and 3 (once) also pay presence 0.5 and frequency 0.25 per occurrence.
    assert out[0].tolist() == [1.0, -2.0, 0.25 - 0.5 - 0.5, -4.0 - 0.25 - 0.5, 3.0, 0.0]
    # Row 1: negative frequency penalty rewards token 4 (output twice); no repetition.
    assert out[1].tolist() == [2.0, -1.0, 0.5, -2.0, 5.0, 0.0]


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [[0, 1, 2]], [[]], torch.tensor([1.0]), torch.tensor([2.0]),
                          torch.tensor([2.0]))
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_logit_bias_adds_to_exactly_the_listed_tokens():
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias={1: 5.0, 3: -100.0, 99: 1.0}), SamplingParams()]
    out = process_logits(logits, make_meta(params))
    assert out.tolist() == [[0.0, 5.0, 0.0, -100.0, 0.0], [0.0] * 5]  # id 99 out of vocab
    assert logits.tolist() == [[0.0] * 5] * 2


def test_logit_bias_applies_before_penalties():
    logits = torch.tensor([[1.0, 0.0]])
    params = SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0)
    out = process_logits(logits, make_meta([params], prompt_token_ids=[[0]]))
    assert out.tolist() == [[2.0, 0.0]]  # (1 + 3) / 2


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(4, 8)
    params = [SamplingParams(min_tokens=3, stop_token_ids=[5]),   # 1 output token: masked
              SamplingParams(min_tokens=3, stop_token_ids=[5]),   # 3 output tokens: free
              SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
              SamplingParams()]
    out = process_logits(logits, make_meta(params, output_token_ids=[[7], [7, 7, 7], [7], []]))
    inf = -math.inf
    assert out.tolist() == [[0, 0, inf, 0, 0, inf, 0, 0], [0.0] * 8,
                            [0, 0, 0, 0, 0, inf, 0, 0], [0.0] * 8]


def test_min_tokens_prevents_sampling_eos():
    logits = torch.tensor([[0.0, 0.0, 10.0, 1.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert Sampler()(logits, make_meta([params], output_token_ids=[[3]])).token_ids == [3]
    assert Sampler()(logits, make_meta([params], output_token_ids=[[3, 3]])).token_ids == [EOS]


# --- randomness ----------------------------------------------------------------------------

def run_steps(sampler: Sampler, row_logits: torch.Tensor, row_params: SamplingParams,
              generator: torch.Generator, position: int, num_rows: int,
              num_steps: int = 20) -> list[int]:
    """Tokens of the seeded row at `position` over several steps, among unseeded rows."""
    tokens = []
    for _ in range(num_steps):
        logits = torch.randn(num_rows, row_logits.shape[0])
        logits[position] = row_logits
        params = [SamplingParams(temperature=1.3, top_p=0.9) for _ in range(num_rows)]
        params[position] = row_params
        gens: list[torch.Generator | None] = [None] * num_rows
        gens[position] = generator
        tokens.append(sampler(logits, make_meta(params, generators=gens)).token_ids[position])
    return tokens


def test_seeded_row_is_reproducible_regardless_of_batch_and_position():
    torch.manual_seed(0)
    row_logits = torch.randn(64)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = run_steps(Sampler(seed=0), row_logits, params, seeded(42), position=0, num_rows=1)
    in_batch = run_steps(Sampler(seed=7), row_logits, params, seeded(42), position=3,
                         num_rows=5)
    other_seed = run_steps(Sampler(seed=0), row_logits, params, seeded(43), position=0,
                           num_rows=1)
    assert alone == in_batch
    assert len(set(alone)) > 5  # it really samples
    assert alone != other_seed


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.randn(8, 100, generator=seeded(1))
    params = [SamplingParams() for _ in range(8)]
    first = [Sampler(seed=5)(logits, make_meta(params)).token_ids for _ in range(2)]
    second = [Sampler(seed=5)(logits, make_meta(params)).token_ids for _ in range(2)]
    assert first == second


# --- logprobs ------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_after_penalties_before_temperature():
    logits = torch.randn(3, 30, generator=seeded(3))
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0)]
    meta = make_meta(params, output_token_ids=[[4, 4, 9], [], []])
    out = Sampler()(logits, meta)
    processed = logits.clone()
    processed[0, 4] -= 2.0
    processed[0, 9] -= 1.0
    expected = processed.log_softmax(dim=-1)

    lp0 = out.logprobs[0]
    assert lp0 is not None and lp0.token_id == out.token_ids[0]
    assert lp0.logprob == pytest.approx(expected[0, out.token_ids[0]].item(), abs=1e-5)
    top_values, top_ids = expected[0].topk(5)
    assert [t for t, _ in lp0.top] == top_ids.tolist()
    assert [v for _, v in lp0.top] == pytest.approx(top_values.tolist(), abs=1e-5)
    assert [v for _, v in lp0.top] == sorted((v for _, v in lp0.top), reverse=True)

    lp1 = out.logprobs[1]
    assert lp1 is not None and lp1.top == []
    assert lp1.token_id == int(logits[1].argmax())
    assert lp1.logprob == pytest.approx(expected[1].max().item(), abs=1e-5)
    assert out.logprobs[2] is None


def test_metadata_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 entries"):
        Sampler()(torch.zeros(2, 4), make_meta([SamplingParams()]))
