"""POST /v1/completions on a real `plait serve`: prompt forms, echo, logprobs, best_of."""

from __future__ import annotations

import uuid

import pytest
from helpers.server import MODEL, RemoteServer, parse_sse

GREEDY = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}


def tokens_of(server: RemoteServer, text: str) -> list[int]:
    return server.http().post("/tokenize", json={"model": MODEL, "prompt": text}).json()[
        "tokens"]


def test_list_and_token_prompts_are_indexed_p_times_n_plus_j(server: RemoteServer) -> None:
    client = server.openai()
    texts = ["The sky is", "My dog likes"]
    ids = [tokens_of(server, t) for t in texts]
    by_text = client.completions.create(prompt=texts, n=2, max_tokens=3, **GREEDY)
    by_ids = client.completions.create(prompt=ids, n=2, max_tokens=3, **GREEDY)
    alone = client.completions.create(prompt=texts[1], max_tokens=3, **GREEDY)
    for result in (by_text, by_ids):
        assert [c.index for c in result.choices] == [0, 1, 2, 3]
        got = [c.text for c in result.choices]
        assert got[0] == got[1] and got[2] == got[3] and got[0] != got[2]
        assert got[2] == alone.choices[0].text
        assert result.usage.prompt_tokens == len(ids[0]) + len(ids[1])  # once per prompt
        assert result.usage.completion_tokens == 12
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    single = client.completions.create(prompt=ids[0], max_tokens=3, **GREEDY)
    assert single.choices[0].text == by_text.choices[0].text


def test_echo_with_logprobs_includes_the_prompt_tokens(server: RemoteServer) -> None:
    prompt = "The capital of France is"
    num_prompt = len(tokens_of(server, prompt))
    result = server.openai().completions.create(prompt=prompt, max_tokens=3, echo=True,
                                                logprobs=2, **GREEDY)
    choice = result.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == \
        len(lp.text_offset) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert "".join(lp.tokens[:num_prompt]) == prompt
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets  # from the start of the returned text
    for top, token, value in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:],
                                 strict=True):
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value)
    generated = lp.token_logprobs[num_prompt:]  # greedy: the sampled token is the top one
    assert all(max(top.values()) == pytest.approx(v)
               for top, v in zip(lp.top_logprobs[num_prompt:], generated, strict=True))


def test_echo_with_max_tokens_zero_scores_the_prompt(server: RemoteServer) -> None:
    prompt = "Paris is a city"
    result = server.openai().completions.create(prompt=prompt, max_tokens=0, echo=True,
                                                logprobs=0, model=MODEL)
    choice = result.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == prompt
    assert result.usage.completion_tokens == 0


def test_logprobs_without_echo_offsets_count_from_the_generated_text(server) -> None:
    result = server.openai().completions.create(prompt="One, two,", max_tokens=4, logprobs=1,
                                                **GREEDY)
    lp = result.choices[0].logprobs
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == result.choices[0].text
    assert all(len(top) == 1 for top in lp.top_logprobs)  # greedy: top-1 is the sample


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(server) -> None:
    client = server.openai()
    kwargs = {"model": MODEL, "prompt": "A short poem:", "max_tokens": 3, "seed": 77,
              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    samples = client.completions.create(n=3, logprobs=0, **kwargs)
    ranked = sorted(samples.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=3, **kwargs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # not asked for
    assert best.usage.completion_tokens == 9  # every sample generated counts


def test_stream_two_prompts_n2_matches_the_non_streamed_text(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": ["Red, green,", "Monday, Tuesday,"], "n": 2,
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with server.http() as http:
        raw = http.post("/v1/completions", json={**body, "stream": True})
        expected = http.post("/v1/completions", json=body).json()
    sse = parse_sse(raw.content)
    assert sse.events[-1] == "[DONE]"
    chunks = sse.chunks
    assert {(c["id"], c["created"], c["object"]) for c in chunks} == \
        {(chunks[0]["id"], chunks[0]["created"], "text_completion")}
    for choice in expected["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert mine[-1]["finish_reason"] == "length"


def test_cached_tokens_count_the_prompt_once_per_request(server: RemoteServer) -> None:
    prompt = f"{uuid.uuid4().hex} is an identifier; describe it in a few words please."
    num_prompt = len(tokens_of(server, prompt))
    assert num_prompt > 16
    client = server.openai()
    first = client.completions.create(prompt=prompt, n=3, max_tokens=2, **GREEDY)
    again = client.completions.create(prompt=prompt, n=3, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == num_prompt
    # Computed once, read from the shared prefill by choices 2 and 3: 2/3 of the n reads.
    assert first.usage.prompt_tokens_details.cached_tokens == 2 * num_prompt // 3
    assert again.usage.prompt_tokens_details.cached_tokens == num_prompt
