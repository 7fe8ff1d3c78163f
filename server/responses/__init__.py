"""The OpenAI Responses API (`/v1/responses`) as a translation onto the chat pipeline.

    protocol.py    the request body (strict: unknown fields are 400s naming them)
    translate.py   input items, instructions, tools, text.format -> a ChatCompletionRequest
    objects.py     finished choices -> output items, usage, the response object
    stream.py      chat deltas (output_reader.ChoiceStream) -> Responses SSE events
    store.py       the bounded in-memory store behind previous_response_id and GET/DELETE
    route.py       the routes

A request is translated into the chat request it means and then runs through chat's own
`chat_input` (checks, chat template, tools, grammars) and `Generation` (fan-out, merger):
the Responses path adds no second copy of either.
"""
