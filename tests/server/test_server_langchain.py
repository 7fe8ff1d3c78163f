"""LangChain's `with_structured_output` and `bind_tools` against a real `plait serve`
(default model). Skipped when langchain-openai is not installed (it is in the `test` extra)."""

from __future__ import annotations

import pytest
from helpers.server import MODEL, RemoteServer, shared_server
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(min_length=1, max_length=16)


@pytest.fixture(scope="module")
def llm(server_url: str):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server_url}/v1",
                                       api_key=shared_server().api_key, max_tokens=60, seed=3,
                                       max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def server_url() -> str:
    server: RemoteServer = shared_server()
    return server.url


def test_with_structured_output(llm) -> None:
    person = llm.with_structured_output(Person).invoke("Invent a person with a name and age.")
    assert isinstance(person, Person)


@pytest.mark.parametrize("tool_choice", ["GetWeather", "any"])
def test_bind_tools(llm, tool_choice: str) -> None:
    bound = llm.bind_tools([GetWeather], tool_choice=tool_choice, parallel_tool_calls=False)
    message = bound.invoke("What is the weather in Paris?")
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])
