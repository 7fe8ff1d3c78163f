"""Chat-template failures are 400s: a template's own error message reaches the client, any
other exception's text (which may name internals) stays in the log."""

from __future__ import annotations

import logging

import pytest

from plait.engine.model_loader import load_tokenizer
from plait.server.errors import APIError
from plait.server.prompts import chat_token_ids

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def fresh_tokenizer(default_model):
    return load_tokenizer(default_model.path)  # its chat template is changed below


def test_template_error_message_reaches_the_client(fresh_tokenizer) -> None:
    fresh_tokenizer.chat_template = "{{ raise_exception('Roles must alternate user/assistant') }}"
    with pytest.raises(APIError) as info:
        chat_token_ids(fresh_tokenizer, MESSAGES)
    error = info.value
    assert (error.status, error.param, error.code) == (400, "messages", "invalid_value")
    assert error.message == ("The messages do not fit the model's chat template: "
                             "Roles must alternate user/assistant")


def test_other_template_failures_are_a_generic_400(fresh_tokenizer, caplog) -> None:
    fresh_tokenizer.chat_template = "{{ 1 // 0 }}"  # ZeroDivisionError, not a TemplateError
    with caplog.at_level(logging.ERROR, logger="plait.server"), \
            pytest.raises(APIError) as info:
        chat_token_ids(fresh_tokenizer, MESSAGES)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message == "The messages do not fit the model's chat template."
    assert "ZeroDivisionError" in caplog.text  # the details are in the log only


def test_the_default_template_still_works(fresh_tokenizer) -> None:
    ids = chat_token_ids(fresh_tokenizer, MESSAGES)
    assert fresh_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
