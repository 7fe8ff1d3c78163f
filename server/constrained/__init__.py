"""Tools and structured output: the stages between a chat request's `tools` /
`tool_choice` / `response_format` and the message the client gets back.

    request_fields.py   parse: the OpenAI shapes of response_format, tools, tool_choice and
                        a message's tool_calls, validated strictly (400s naming the field)
    output_plan.py      plan: which constraint a request gets, how the conversation is
                        rendered (tools in the template or in a system message), how the
                        output is read back (`OutputPlan`)
    grammars.py         build: response_format / tool schemas -> a checked `StructuredSpec`
                        (compact, closed objects; the Lark grammar of tool_choice "auto")
    call_parsers.py     read: a model family's tool-call format in generated text -> calls
                        (the registry and detection; family_parsers.py: mistral, pythonic,
                        phi4_mini_json, granite; parsed.py: their shared result types)
    reasoning_grammar.py  build: a JSON grammar with a --reasoning-parser's <think> first
    schema_check.py     read: does a bare JSON call validate against its tool's parameters
    output_reader.py    render: generated text -> message (content / tool_calls), whole or
                        as stream deltas (`ChoiceStream`)

The routes use it through `chat.chat_input` (plan) and the renderers (chat.py,
responses/); /v1/completions uses `grammars.answer_spec` only.
"""
