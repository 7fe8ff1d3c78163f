"""Structured output through the engine (offline `LLM` API and `EngineCore`): every kind of
constraint, schema coverage validated with jsonschema, n>1 seeds and prompt sharing, the
"grammar never changes an allowed pick" rule, preemption, bad grammars, length cuts."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import pytest
from helpers.engine import assert_pool_clean, prompt, run_until_done, tokens_of

from plait import LLM, SamplingParams
from plait.engine import AsyncEngine, EngineConfig, ProcessEngine, StructuredSpec
from plait.engine.faults import FaultSite, install_fault_hook

SCHEMAS = {
    "object_enum_bounds": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "color": {"enum": ["red", "green", "blue"]},
                       "age": {"type": "integer", "minimum": 18, "maximum": 99}},
        "required": ["name", "color", "age"], "additionalProperties": False},
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "nested_refs": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -5,
                                                 "maximum": 5},
                                           "y": {"type": "integer", "minimum": -5,
                                                 "maximum": 5}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False},
    "numbers": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0.5, "maximum": 10},
                       "count": {"type": "integer", "exclusiveMinimum": 0,
                                 "exclusiveMaximum": 10}},
        "required": ["price", "count"], "additionalProperties": False},
}
# A bounded schema for the tiny random model (its tokens are noise: only bounds end them,
# and no whitespace between JSON tokens, llguidance's "x-guidance" option).
SMALL = {"type": "object",
         "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "integer", "minimum": 0,
                                                          "maximum": 99},
                        "s": {"type": "string", "maxLength": 4}},
         "required": ["k", "v", "s"], "additionalProperties": False,
         "x-guidance": {"whitespace_pattern": ""}}


def schema_spec(schema: dict) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps(schema))


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # exact numerics: the schema coverage's greedy answers are the float32 model's, each of
    # which ends within max_tokens (int8's differ: its "array" answer repeats to the end)
    return LLM(num_kv_blocks=256, block_size=16, numerics="exact")


def chat(llm: LLM, content: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text)


# ---------------------------------------------------------------- the default model
def test_schema_coverage_every_output_validates(llm: LLM) -> None:
    """Objects, arrays, enums, nested $ref/$defs, string patterns, bounded numbers, greedy
    with the default model, all in one batch (sampled coverage: the tiny model below)."""
    for name, schema in SCHEMAS.items():
        ids = chat(llm, f"Reply with a JSON object matching this schema: {json.dumps(schema)}")
        llm.engine.add_request(name, ids, SamplingParams(
            temperature=0, max_tokens=80, structured=schema_spec(schema)))
    seen = run_until_done(llm)
    for name, schema in SCHEMAS.items():
        text = "".join(d.text for d in seen[name])
        assert seen[name][-1].finish_reason == "stop", (name, text)
        assert_valid(text, schema)
    assert_pool_clean(llm)


def test_regex_choice_json_object_and_lark(llm: LLM) -> None:
    cases = {
        "regex": (StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,4}"), "Give a code like 123-abc."),
        "choice": (StructuredSpec("choice", json.dumps(["alpha", "beta", "gamma"])),
                   "Pick a letter."),
        "object": (StructuredSpec("json_object"), 'Repeat this JSON: {"city": "Paris"}'),
        "lark": (StructuredSpec("lark", 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'),
                 "What is 6 times 7?"),
    }
    for name, (spec, question) in cases.items():
        llm.engine.add_request(name, chat(llm, question),
                               SamplingParams(temperature=0, max_tokens=32, structured=spec))
    seen = run_until_done(llm)
    text = {name: "".join(d.text for d in seen[name]) for name in cases}
    assert [seen[name][-1].finish_reason for name in cases] == ["stop"] * 4, text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text["regex"])
    assert text["choice"] in ("alpha", "beta", "gamma")
    assert isinstance(json.loads(text["object"]), dict)
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", text["lark"])


def test_an_allowed_pick_is_never_changed_by_the_grammar(llm: LLM) -> None:
    """A permissive grammar gives the unconstrained tokens (and logprobs); a grammar that
    forbids the letter 'e' follows them up to the first token with an 'e', then differs."""
    ids = chat(llm, "Write one sentence about the sea.")
    base = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, logprobs=2)
    free = llm.generate([ids], base)[0].outputs
    grammars = llm.engine.grammars
    spec = StructuredSpec("regex", r"(.|\n)*")
    for out in free:  # precondition: the permissive grammar allows every free token
        grammars.submit(spec).result(timeout=60)
        matcher = grammars.grammar(spec)
        assert all(matcher.accept(t) for t in out.token_ids)
    base.structured = spec
    same = llm.generate([ids], base)[0].outputs
    assert [o.token_ids for o in same] == [o.token_ids for o in free]
    assert [o.logprobs for o in same] == [o.logprobs for o in free]
    base.structured = StructuredSpec("regex", r"[^eE]*")
    no_e = llm.generate([ids], base)[0].outputs
    tok = llm.tokenizer
    for free_out, out in zip(free, no_e, strict=True):
        assert "e" not in out.text.lower()
        first = next(i for i, t in enumerate(free_out.token_ids) if "e" in tok.decode([t]).lower())
        assert out.token_ids[:first] == free_out.token_ids[:first]
        assert out.token_ids[first] != free_out.token_ids[first]


def test_logprobs_of_a_constrained_row_are_read_before_the_mask(llm: LLM) -> None:
    ids = chat(llm, "Is the sky green?")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    free = llm.generate([ids], params)[0].outputs[0].logprobs[0]
    params.structured = StructuredSpec("choice", json.dumps(["maybe", "perhaps"]))
    bound = llm.generate([ids], params)[0].outputs[0].logprobs[0]
    assert bound.top == free.top  # the same (unmasked) distribution
    assert bound.token_id != free.token_id
    first = llm.tokenizer.decode([bound.token_id])
    assert first and ("maybe".startswith(first) or "perhaps".startswith(first))


def test_stop_strings_and_max_tokens_still_apply(llm: LLM) -> None:
    ids = chat(llm, "What is 6 times 7?")
    lark = StructuredSpec("lark", 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/')
    stopped = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, stop=["answer"],
                                                 structured=lark))[0].outputs[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == ("The ", "stop",
                                                                          "answer")
    cut = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3,
                                             structured=lark))[0].outputs[0]
    assert (len(cut.token_ids), cut.finish_reason) == (3, "length")
    assert "The answer is ".startswith(cut.text)


# ---------------------------------------------------------------- the tiny model
@pytest.fixture(scope="module")
def tiny(tiny_path) -> LLM:
    return LLM(str(tiny_path), num_kv_blocks=128, block_size=16)


@pytest.fixture(scope="module")
def tiny_solo(tiny_path) -> LLM:
    return LLM(str(tiny_path), num_kv_blocks=128, block_size=16, enable_prefix_caching=False)


def test_schema_coverage_with_random_tokens(tiny: LLM) -> None:
    """The tiny random model's tokens are noise, so only the grammar shapes its output: three
    seeded samples of every schema (no whitespace between JSON tokens) all validate. (Its
    numbers are integers only: noise never stops writing a fraction's digits.)"""
    schemas = {**SCHEMAS, "numbers": {
        "type": "object", "properties": {"count": SCHEMAS["numbers"]["properties"]["count"],
                                         "delta": {"type": "integer", "minimum": -50,
                                                   "maximum": -10}},
        "required": ["count", "delta"], "additionalProperties": False}}
    for name, schema in schemas.items():
        compact = {**schema, "x-guidance": {"whitespace_pattern": ""}}
        for i in range(3):
            tiny.engine.add_request(f"{name}-{i}", prompt(20 + i, 10), SamplingParams(
                temperature=1.0, seed=i, max_tokens=64, structured=schema_spec(compact)))
    seen = run_until_done(tiny)
    for name, schema in schemas.items():
        for i in range(3):
            deltas = seen[f"{name}-{i}"]
            text = "".join(d.text for d in deltas)
            assert deltas[-1].finish_reason == "stop", (name, i, text)
            assert_valid(text, schema)
    assert_pool_clean(tiny)


def test_seeded_choices_equal_single_requests_and_the_prompt_is_computed_once(
        tiny: LLM, tiny_solo: LLM) -> None:
    ids = prompt(3, 40)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=64,
                            structured=schema_spec(SMALL))
    before = tiny.stats().prompt_tokens_computed
    outs = tiny.generate([ids], params)[0].outputs
    assert tiny.stats().prompt_tokens_computed - before == len(ids)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop"
        assert_valid(out.text, SMALL)
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=64,
                                structured=schema_spec(SMALL))
        assert tiny_solo.generate([ids], single)[0].outputs[0].token_ids == out.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the seeds do matter
    assert_pool_clean(tiny)


def test_preemption_and_recompute_keep_outputs_valid_and_unchanged(tiny_path,
                                                                   tiny_solo: LLM) -> None:
    llm = LLM(str(tiny_path), num_kv_blocks=24, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=64)
    jobs = [(f"r{i}", prompt(10 + i, 6 + i),
             SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=40,
                            structured=schema_spec(SMALL)))
            for i in range(6)]
    for rid, ids, params in jobs:
        llm.engine.add_request(rid, ids, params)
    seen = run_until_done(llm)
    assert llm.stats().num_preemptions > 0
    for rid, ids, params in jobs:
        expected = tiny_solo.generate([ids], params)[0].outputs[0]
        assert tokens_of(seen[rid]) == expected.token_ids, rid
        assert seen[rid][-1].finish_reason == expected.finish_reason
        if expected.finish_reason == "stop":
            assert_valid(expected.text, SMALL)
    assert any(seen[rid][-1].finish_reason == "stop" for rid, _, _ in jobs)
    assert_pool_clean(llm)


def test_a_failed_sampling_row_advances_no_matcher(tiny_path, tiny_solo: LLM) -> None:
    """A fault in the batched sampling call (one request's row, at its 4th token) makes the
    runner sample each row alone, generators rewound: the faulty request fails alone, and
    the structured neighbours' matchers see each kept token exactly once (their outputs
    equal their solo runs)."""
    llm = LLM(str(tiny_path), num_kv_blocks=128, block_size=16)
    victim = prompt(40, 9)

    def hook(phase: str, site: FaultSite) -> None:
        if phase == "sample" and list(site.prompt_token_ids) == victim \
                and site.num_output_tokens == 3:
            raise RuntimeError("injected sampling fault")

    install_fault_hook(llm.engine, hook)
    jobs = {"victim": (victim, SamplingParams(temperature=1.0, seed=3, max_tokens=64,
                                              structured=schema_spec(SMALL))),
            "seeded": (prompt(41, 9), SamplingParams(temperature=1.0, seed=4, max_tokens=64,
                                                     structured=schema_spec(SMALL))),
            "greedy": (prompt(42, 9), SamplingParams(temperature=0, max_tokens=64,
                                                     structured=schema_spec(SMALL)))}
    for rid, (ids, params) in jobs.items():
        llm.engine.add_request(rid, ids, params)
    seen = run_until_done(llm)
    assert len(tokens_of(seen["victim"])) == 3 and seen["victim"][-1].finish_reason == "error"
    for rid in ("seeded", "greedy"):
        ids, params = jobs[rid]
        expected = tiny_solo.generate([ids], params)[0].outputs[0]
        assert tokens_of(seen[rid]) == expected.token_ids, rid
        assert seen[rid][-1].finish_reason == "stop"
        assert len(expected.token_ids) > 3
    assert "injected sampling fault" in llm.stats().last_error
    assert_pool_clean(llm)


def test_a_bad_grammar_fails_only_its_own_request(tiny: LLM) -> None:
    good = SamplingParams(temperature=0, max_tokens=64, structured=schema_spec(SMALL))
    tiny.engine.add_request("bad", prompt(1, 8), SamplingParams(
        structured=StructuredSpec("regex", "a(")))
    tiny.engine.add_request("plain", prompt(2, 8), SamplingParams(temperature=0, max_tokens=4,
                                                                  ignore_eos=True))
    tiny.engine.add_request("good", prompt(3, 8), good)
    seen = run_until_done(tiny)
    bad = seen["bad"]
    assert (len(bad), bad[0].finish_reason, bad[0].token_ids) == (1, "error", [])
    assert "cannot be compiled" in bad[0].error and "unclosed group" in bad[0].error
    assert seen["plain"][-1].finish_reason == "length" and len(tokens_of(seen["plain"])) == 4
    assert seen["good"][-1].finish_reason == "stop"
    assert_valid("".join(d.text for d in seen["good"]), SMALL)
    assert tiny.engine.compiling == {} and tiny.stats().failed_steps == 0


def test_a_request_aborted_while_its_grammar_compiles(tiny: LLM, monkeypatch) -> None:
    """The compile is held until the abort happened: the request never enters the
    scheduler, the compiled grammar still lands in the cache, later steps say nothing."""
    spec = StructuredSpec("regex", "[a-z]{1,7}-never-seen-before")
    compiler = tiny.engine.grammars
    release = threading.Event()
    compile_now = compiler._compile

    def held_compile(held: StructuredSpec):
        assert release.wait(60)
        return compile_now(held)

    monkeypatch.setattr(compiler, "_compile", held_compile)
    tiny.engine.add_request("x", prompt(4, 8), SamplingParams(structured=spec))
    _, future = tiny.engine.compiling["x"]
    assert not future.done()
    delta = tiny.engine.abort("x")
    assert delta is not None and delta.finish_reason == "abort"
    assert not tiny.engine.has_unfinished() and tiny.engine.compiling == {}
    release.set()
    future.result(timeout=60)
    assert spec in compiler._cache
    assert tiny.engine.step().deltas == [] and not tiny.engine.has_unfinished()
    assert_pool_clean(tiny)


def test_the_grammar_ends_the_request_even_below_min_tokens_or_with_ignore_eos(
        tiny: LLM) -> None:
    spec = StructuredSpec("choice", json.dumps(["yes", "no"]))
    for extra in (dict(min_tokens=10), dict(ignore_eos=True)):
        out = tiny.generate([prompt(5, 8)], SamplingParams(temperature=0, max_tokens=20,
                                                           structured=spec, **extra))
        choice = out[0].outputs[0]
        assert (choice.text in ("yes", "no"), choice.finish_reason) == (True, "stop"), extra


# ---------------------------------------------------------------- both engine modes
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_structured_requests_in_the_async_engines(tiny_path, mode: str) -> None:
    """The spec crosses to the engine process; choices stream; a bad grammar is an error
    delta of its own request."""
    config = EngineConfig(model=str(tiny_path), num_kv_blocks=64)
    engine = AsyncEngine(config) if mode == "thread" else ProcessEngine(config)
    good = SamplingParams(temperature=1.0, max_tokens=64, structured=schema_spec(SMALL))

    async def scenario() -> None:
        engine.start(asyncio.get_running_loop())
        streams = [engine.add_request(f"c-{i}", prompt(6, 12), good.for_choice(i))
                   for i in range(2)]
        bad = engine.add_request("bad", prompt(7, 12), SamplingParams(
            structured=StructuredSpec("lark", "start: nothing_defined")))
        for stream in streams:
            deltas = [delta async for delta in stream]
            assert deltas[-1].finish_reason == "stop"
            assert_valid("".join(d.text for d in deltas), SMALL)
        errors = [delta async for delta in bad]
        assert [d.finish_reason for d in errors] == ["error"]
        assert "cannot be compiled" in errors[0].error

    engine.load()
    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown(30)
