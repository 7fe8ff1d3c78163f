"""`plait serve` on a GGUF of each new family answers the openai SDK.

The files are the tiny fixtures of tests/helpers/families/, converted by llama.cpp's own
converter (Q8_0; helpers/gguf_convert.py, which skips when its source distribution cannot
be had). One real server each: /v1/models, a seeded completion with n=2 (choice i equals
n=1 with seed + i), a streamed one, and a chat request. Files with the SmolLM2 tokenizer
carry its chat template, so chat answers; the SentencePiece ones (gemma2, gemma3, phi3)
carry none, so chat is the 400 that says so, until `--chat-template` gives one.
(Parity of the tokens with transformers: tests/engine/test_families_gguf.py.)
"""

from __future__ import annotations

import openai
import pytest
from helpers.gguf_convert import family_gguf
from helpers.server import RemoteServer, start_server

FAMILIES = ("qwen3", "gemma3", "gemma2", "phi3", "granite", "smollm3", "olmo2")
WITHOUT_TEMPLATE = {"gemma2", "gemma3", "phi3"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _serve(family: str, *extra: str) -> RemoteServer:
    server = start_server([str(family_gguf(family, "q8_0")), "--served-model-name", family,
                           "--num-kv-blocks", "128", "--max-model-len", "1024", *extra])
    server.wait_healthy()
    return server


@pytest.mark.parametrize("family", FAMILIES)
def test_plait_serve_answers_the_openai_sdk(family: str) -> None:
    server = _serve(family)
    try:
        client = server.openai()
        assert [m.id for m in client.models.list().data] == [family]
        prompt = "The licence grants you the freedom to"
        both = client.completions.create(model=family, prompt=prompt, n=2, seed=5,
                                         max_tokens=8, extra_body={"ignore_eos": True})
        assert [c.index for c in both.choices] == [0, 1]
        assert both.usage.completion_tokens == 16
        for i, choice in enumerate(both.choices):
            solo = client.completions.create(model=family, prompt=prompt, seed=5 + i,
                                             max_tokens=8, extra_body={"ignore_eos": True})
            assert solo.choices[0].text == choice.text
        chunks = list(client.completions.create(model=family, prompt=prompt, n=2,
                                                max_tokens=4, stream=True,
                                                extra_body={"ignore_eos": True}))
        assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
        messages = [{"role": "user", "content": "Say something."}]
        if family in WITHOUT_TEMPLATE:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=family, messages=messages,
                                               max_tokens=4)
            assert "chat template" in refused.value.message
        else:
            chat = client.chat.completions.create(model=family, messages=messages, n=2,
                                                  max_tokens=4)
            assert [c.index for c in chat.choices] == [0, 1]
            assert chat.usage.completion_tokens >= 2
    finally:
        server.stop()


def test_a_family_without_a_template_chats_with_chat_template() -> None:
    server = _serve("gemma3", "--chat-template", CHATML)
    try:
        chat = server.openai().chat.completions.create(
            model="gemma3", max_tokens=4, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Say something."}])
        assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"
    finally:
        server.stop()
