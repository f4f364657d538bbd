"""Structured outputs on the embedded model: every constrained output parses and validates
(hypothesis-generated JSON schemas too), a constraint the greedy output already satisfies
changes no token, bad or unsatisfiable constraints are refused when the request is added, and
masks are computed off the engine thread."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstack import LLM, SamplingParams
from kvstack.engine.request import Request
from kvstack.errors import InvalidRequestError
from kvstack.layers.sampler import SamplingState
from kvstack.sampling_params import StructuredOutputsParams as Constraint
from kvstack.structured import StructuredBackend, guides
from kvstack.structured import grammars as grammars_module

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Give a JSON object with keys name and age for a "
                                          "person called Ann aged 30. JSON only."}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    llm = LLM("smollm2-135m", kv_cache_memory="64MiB")
    yield llm
    llm.engine.check_integrity()
    assert llm.stats().num_blocks_used == 0


def greedy(max_tokens: int = 48, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def chat(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> Any:
    return llm.chat(messages, params)[0].outputs[0]


@pytest.mark.parametrize("constraint", [
    Constraint(json=PERSON),
    Constraint(json=json.dumps(PERSON), strict=False),
    Constraint(json_object=True),
    Constraint(regex=r'\{\s*"name": "[A-Za-z]+",\s*"age": \d+\s*\}'),
], ids=["schema", "schema text", "json object", "regex"])
def test_a_constraint_the_greedy_output_satisfies_changes_no_token(llm: LLM,
                                                                   constraint: Any) -> None:
    free = chat(llm, ASK_PERSON, greedy())
    assert free.finish_reason == "stop"
    jsonschema.validate(json.loads(free.text), PERSON)  # the model's own answer fits
    constrained = chat(llm, ASK_PERSON, greedy(structured_outputs=constraint))
    assert constrained.token_ids == free.token_ids


def test_choice_and_regex_of_a_short_answer_keep_the_greedy_tokens(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    free = chat(llm, messages, greedy(8))
    for constraint in (Constraint(choice=[free.text, "Maybe."]),
                       Constraint(regex=re.escape(free.text)),
                       Constraint(grammar=f"start: {json.dumps(free.text)} | \"Perhaps\"")):
        assert chat(llm, messages, greedy(8, structured_outputs=constraint)).token_ids == \
            free.token_ids


def test_a_finished_request_releases_its_guide(llm: LLM) -> None:
    params = greedy(8, structured_outputs=Constraint(choice=["Paris", "Rome"]))
    request = llm.engine.add_request("The capital of France is", params)
    assert isinstance(request, Request) and request.sampling_state.guide is not None
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.text in ("Paris", "Rome")  # the guide held while it ran
    assert request.finished and request.sampling_state.guide is None  # released at the end


@pytest.mark.parametrize("constraint, check", [
    (Constraint(choice=["Paris", "London", "Rome"]), lambda t: t in ("Paris", "London", "Rome")),
    (Constraint(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    (Constraint(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'),
     lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t)),
    (Constraint(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
], ids=["choice", "regex", "lark", "gbnf"])
def test_sampled_outputs_follow_the_constraint(llm: LLM, constraint: Any, check: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(n=4, temperature=1.2, seed=3, max_tokens=24,
                            structured_outputs=constraint)
    out = llm.chat(messages, params)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and check(c.text), c.text


_LEAF = st.sampled_from([
    {"type": "string", "maxLength": 12}, {"type": "integer"}, {"type": "boolean"},
    {"type": "number"}, {"enum": ["red", "green", "blue"]}, {"type": "null"},
    {"type": "string", "pattern": "^[a-z]{1,6}$"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
])


@st.composite
def schemas(draw: Any) -> dict[str, Any]:
    names = draw(st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True), min_size=1,
                          max_size=4, unique=True))
    properties = {n: draw(_LEAF) for n in names}
    if draw(st.booleans()):
        inner = draw(st.sampled_from(names))
        properties[inner] = {"type": "object", "properties": {"x": draw(_LEAF)},
                             "required": ["x"], "additionalProperties": False}
    required = draw(st.lists(st.sampled_from(names), unique=True))
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(schema=schemas(), temperature=st.sampled_from([0.0, 0.8]), seed=st.integers(0, 99))
@example(schema={"type": "object", "properties": {"b": {"type": "integer"}}, "required": [],
                 "additionalProperties": False}, temperature=0.8, seed=1)  # digits past 160
def test_every_constrained_output_parses_and_validates(llm: LLM, schema: dict[str, Any],
                                                       temperature: float, seed: int) -> None:
    messages = [{"role": "user", "content": "Describe a thing as a JSON object."}]
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=160,
                            structured_outputs=Constraint(json=schema))
    out = chat(llm, messages, params)
    if out.finish_reason == "length":
        # An unbounded integer or number may outrun max_tokens (sampled digits need not end):
        # then the cut output must still be, token by token, a prefix the schema allows.
        tokenizer = llm.get_tokenizer()
        backend = StructuredBackend.for_tokenizer(tokenizer, llm.model_config.vocab_size, {2})
        matcher = backend.compile(params.structured_outputs).template.deep_copy()
        assert matcher.consume_tokens(list(out.token_ids)) and not matcher.is_error(), out.text
        return
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def test_parallel_samples_each_follow_the_schema(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=80,
                            structured_outputs=Constraint(json=PERSON))
    out = llm.chat(ASK_PERSON, params)[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)


@pytest.mark.parametrize("constraint, message", [
    (Constraint(json={"type": "strnig"}), "invalid JSON schema"),
    (Constraint(json="{not json"), "not JSON"),
    (Constraint(json={"type": "string", "minLength": 5, "maxLength": 2}), "Unsatisfiable"),
    (Constraint(json={"type": "string", "format": "no-such-format"}), "format"),
    (Constraint(regex="[a-"), "invalid regex"),
    (Constraint(regex=r"[^\s\S]"), "matches no output"),
    (Constraint(grammar="start: undefined_rule"), "invalid grammar"),
], ids=["bad type", "not json", "unsatisfiable", "strict format", "bad regex",
        "empty regex", "bad grammar"])
def test_bad_constraints_are_refused_when_added(llm: LLM, constraint: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.generate("Hi", greedy(4, structured_outputs=constraint))
    assert "\n" not in str(err.value)
    assert not llm.engine.requests


def test_a_lenient_schema_ignores_what_it_cannot_enforce(llm: LLM) -> None:
    schema = {"type": "string", "format": "no-such-format", "maxLength": 8}
    out = llm.generate("Hi", greedy(16, structured_outputs=Constraint(json=schema,
                                                                      strict=False)))[0]
    assert isinstance(json.loads(out.outputs[0].text), str)


def test_parameters_that_cannot_combine_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Constraint()
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=Constraint(regex="a"))
    assert not SamplingParams(temperature=0, structured_outputs=Constraint(
        regex="a")).verifies_drafts


def test_masks_are_computed_off_the_engine_thread(llm: LLM, monkeypatch: Any) -> None:
    threads: set[str] = set()
    original = guides._fill

    def spy(*args: Any) -> None:
        threads.add(threading.current_thread().name)
        original(*args)

    monkeypatch.setattr(guides, "_fill", spy)
    out = llm.generate("The capital of France is", greedy(
        6, structured_outputs=Constraint(regex=r" [A-Z][a-z]+[.,]?( [a-z]+)*")))[0]
    assert out.outputs[0].text
    assert threads and all(name.startswith("kvstack-masks") for name in threads)


def test_a_guide_allows_only_what_continues_the_constraint(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    backend = StructuredBackend.for_tokenizer(tokenizer, llm.model_config.vocab_size, {2})
    grammar = backend.compile(Constraint(choice=["yes", "no"]))
    state = SamplingState(greedy(), [], [])
    guide = backend.guide(grammar, state)
    allowed = guide.allowed_tokens(llm.model_config.vocab_size)
    texts = {tokenizer.decode([int(i)]) for i in torch.nonzero(allowed).flatten()}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    state.output_token_ids.extend(tokenizer.encode("yes"))
    allowed = guide.allowed_tokens(llm.model_config.vocab_size)
    assert torch.nonzero(allowed).flatten().tolist() == [2]  # only the end of sequence


def test_without_llguidance_the_error_says_how_to_install_it(monkeypatch: Any) -> None:
    import builtins

    real_import = builtins.__import__

    def no_llguidance(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "llguidance" or name.startswith("llguidance."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(InvalidRequestError, match=r"kvstack\[structured\]"):
        grammars_module.llguidance()
