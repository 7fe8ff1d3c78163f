"""The OpenAI Agents SDK (`openai-agents`, optional: skipped when not installed) against a
real `plait serve` through `OpenAIResponsesModel`: an `Agent` with one function tool, run
with `Runner.run` and `Runner.run_streamed`. The tool call is forced (tool_choice
"required", as the tiny default model would not choose it reliably) and its output is the
final result (`stop_on_first_tool`)."""

from __future__ import annotations

import pytest
from helpers.server import MODEL, RemoteServer

agents = pytest.importorskip("agents")


async def test_agent_with_a_function_tool(server: RemoteServer) -> None:
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)  # never send traces anywhere
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        cities.append(city)
        return f"22 C and sunny in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=server.async_openai())
    agent = agents.Agent(
        name="weather", instructions="You answer weather questions.", model=model,
        tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0.0,
                                            max_tokens=60, parallel_tool_calls=False))
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2)
    assert len(cities) == 1 and cities[0]
    assert result.final_output == f"22 C and sunny in {cities[0]}"

    streamed = agents.Runner.run_streamed(agent, "What is the weather in Rome?", max_turns=2)
    kinds = [event.type async for event in streamed.stream_events()]
    assert "raw_response_event" in kinds and len(cities) == 2
    assert streamed.final_output == f"22 C and sunny in {cities[1]}"
