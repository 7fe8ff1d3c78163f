"""POST /v1/chat/completions on a real `plait serve` (default model, CPU)."""

from __future__ import annotations

import uuid

import pytest
from helpers.server import MODEL, RemoteServer, parse_sse


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_n_choices_usage_and_cached_tokens(server: RemoteServer) -> None:
    client = server.openai()
    messages = user(f"Tell me about the number {uuid.uuid4().int % 10**9}.")
    num_prompt = server.http().post("/tokenize", json={"model": MODEL, "messages": messages}
                                    ).json()["count"]
    kwargs = {"model": MODEL, "messages": messages, "n": 3, "max_tokens": 4,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(**kwargs)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.message.content for c in first.choices}) == 1  # greedy: all the same
    assert all(c.finish_reason == "length" and c.message.role == "assistant"
               for c in first.choices)
    usage = first.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (num_prompt, 12, num_prompt + 12)
    # The once-counted prompt: its computing choice found only the shared system-prompt
    # blocks in the cache; the other two shared its prefill.
    assert usage.prompt_tokens_details.cached_tokens < num_prompt
    again = client.chat.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens == num_prompt
    assert [c.message.content for c in again.choices] == [c.message.content
                                                          for c in first.choices]


def test_stream_n3_one_role_and_one_finish_per_index(server: RemoteServer) -> None:
    body = {"model": MODEL, "messages": user("Name three colors."), "n": 3, "max_tokens": 6,
            "temperature": 0}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={**body, "stream": True})
        expected = http.post("/v1/chat/completions", json=body).json()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    sse = parse_sse(response.content)
    assert sse.events[-1] == "[DONE]" and "[DONE]" not in sse.events[:-1]
    chunks = sse.chunks
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == \
        {(chunks[0]["id"], chunks[0]["created"], MODEL, "chat.completion.chunk")}
    assert all("usage" not in c for c in chunks)
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert all(len(c["choices"]) == 1 for c in chunks)
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum("role" in c["delta"] for c in mine) == 1
        finishes = [c for c in mine if c["finish_reason"] is not None]
        assert finishes == [mine[-1]] and mine[-1]["delta"] == {}
        assert mine[-1]["finish_reason"] == expected["choices"][index]["finish_reason"]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == expected["choices"][index]["message"]["content"]


async def test_include_usage_chunk_with_the_async_client(server: RemoteServer) -> None:
    client = server.async_openai()
    stream = await client.chat.completions.create(
        model=MODEL, messages=user("Count to five."), n=2, max_tokens=3, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + 6
    assert all(c.usage is None for c in body) and all(len(c.choices) == 1 for c in body)
    with server.http() as http:  # on the wire: "usage": null on every other chunk
        raw = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": user("Hi"), "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}).content
    chunk_dicts = parse_sse(raw).chunks
    assert all(c["usage"] is None for c in chunk_dicts[:-1])
    assert chunk_dicts[-1]["choices"] == [] and chunk_dicts[-1]["usage"]["prompt_tokens"] > 0


def test_logprobs_shapes_and_bytes(server: RemoteServer) -> None:
    client = server.openai()
    result = client.chat.completions.create(
        model=MODEL, messages=user("Say hello."), max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    choice = result.choices[0]
    content = choice.logprobs.content
    assert choice.logprobs.refusal is None and len(content) == 5
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        assert bytes(item.bytes) == item.token.encode()
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy picks the top token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        for top in item.top_logprobs:  # an alternative may be part of a UTF-8 character
            assert bytes(top.bytes).decode(errors="replace") == top.token
    zero = client.chat.completions.create(model=MODEL, messages=user("Say hello."),
                                          max_tokens=2, temperature=0, logprobs=True)
    assert [item.top_logprobs for item in zero.choices[0].logprobs.content] == [[], []]
    plain = client.chat.completions.create(model=MODEL, messages=user("Say hello."),
                                           max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Say hello."), max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, stream=True, extra_body={"ignore_eos": True})
    streamed = [item for chunk in stream for c in chunk.choices if c.logprobs
                for item in c.logprobs.content]
    assert [(i.token, i.bytes) for i in streamed] == [(i.token, i.bytes) for i in content]


def test_stop_strings(server: RemoteServer) -> None:
    client = server.openai()
    kwargs = {"model": MODEL, "messages": user("Write a sentence about cats."),
              "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]
    cut = full.index(stop)
    stopped = client.chat.completions.create(**kwargs, stop=[stop, "never-seen-xyz"])
    assert stopped.choices[0].message.content == full[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    kept = client.chat.completions.create(
        **kwargs, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == full[:cut + len(stop)]


def test_seeded_fan_out_choice_i_uses_seed_plus_i(server: RemoteServer) -> None:
    client = server.openai()
    kwargs = {"model": MODEL, "messages": user("Invent a word."), "max_tokens": 4,
              "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    fanned = client.chat.completions.create(**kwargs, n=2, seed=1234)
    alone = client.chat.completions.create(**kwargs, n=1, seed=1235)
    assert fanned.choices[1].message.content == alone.choices[0].message.content
    repeat = client.chat.completions.create(**kwargs, n=2, seed=1234)
    assert [c.message.content for c in repeat.choices] == \
        [c.message.content for c in fanned.choices]


def test_content_parts_developer_role_and_max_completion_tokens(server: RemoteServer) -> None:
    client = server.openai()
    result = client.chat.completions.create(
        model=MODEL, max_tokens=9, max_completion_tokens=2, temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                               {"type": "text", "text": "there"}]}])
    assert result.usage.completion_tokens == 2  # max_completion_tokens wins
    as_string = server.http().post("/tokenize", json={"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"}]}).json()["count"]
    assert result.usage.prompt_tokens == as_string
