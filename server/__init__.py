"""Plait's OpenAI-compatible HTTP server: `create_app(settings)` in `plait.server.app`.

Modules, one job each:

    app.py          create_app: lifespan (background model load), middleware, routers
    serve.py        run under uvicorn for `plait serve` (drain on SIGTERM, exit codes)
    settings.py     ServerSettings (built by plait/cli.py)
    template_source.py  --chat-template's value -> the template source, checked at start
    state.py        ServerState and the Annotated dependencies routes take
    protocol.py     request bodies (pydantic), unsupported-parameter checks
    params.py       request (+ its output constraint) -> finished SamplingParams, fan-out Plan
    prompts.py      chat template / completion prompts -> token ids, context checks
    reasoning.py    --reasoning-parser: <think> reasoning split from the answer
    fanout.py       n choices -> n engine sub-requests, abort
    merge.py        interleave the sub-requests' delta streams
    generation.py   drive a fanned-out request (async with): accumulate choices (the engine's
                    ChoiceAccumulator), usage, metrics; abort what is unfinished on exit
    serving.py      a Generation as SSE or JSON, the chat/completions stream tail; abort on
                    client disconnect
    logprobs.py     OpenAI logprob objects
    chat.py         POST /v1/chat/completions
    completions.py  POST /v1/completions
    constrained/    tools and structured output: request fields, output plan, grammars,
                    tool-call parsers, reading the output back (its __init__ has the map)
    responses/      POST/GET/DELETE /v1/responses, translated onto the chat pipeline
    render.py       /v1/chat/completions/render, /v1/completions/render
    misc.py         /health /metrics /version /v1/models /tokenize /detokenize
    sse.py          SSE framing and the streaming response
    errors.py       error envelopes; auth.py API keys
    openapi.py      /openapi.json documents the envelope's statuses, never 422
    middleware.py   x-request-id and the 500 envelope; request body size limit (413)
    metrics.py      Prometheus registry per app
    faults.py       test-only fault injection (hidden --fault-injection), off by default

DEVIATIONS (chosen on purpose):
  * `stop`: at most 4 strings, as OpenAI (vLLM allows more).
  * completions `text_offset` counts from the start of the returned text (vLLM), not from
    the start of the prompt.
  * completions `logprobs` 0..5 and `best_of` <= 20, as OpenAI; best_of choices are
    returned best first, and usage counts every generated sample.
  * prompt + max_tokens beyond the context is clamped by the engine, not rejected (OpenAI
    refuses with 400): the choice ends with finish_reason "length" at the context's end. A
    prompt that alone leaves no room for one token is a 400 `context_length_exceeded`.
  * `logit_bias`: at most 300 entries (MAX_LOGIT_BIAS).
  * role "developer" is accepted as "system"; `name` on messages is passed to the template.
  * parameters Plait lacks are rejected (400, `param` set) unless null or an "off" value
    (response_format {"type": "text"}, tool_choice "none", modalities ["text"], store false).
  * `top_p: 0` means greedy; engine seeds: choice j of a prompt uses seed + j.
  * a request cut off by the client gets status 499 (never seen by that client).
"""
