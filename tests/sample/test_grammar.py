"""Structured output with the real V4 vocabulary: compile, mask correctness, generation over random
logits (JSON schema, regex, EBNF, DSML tool calls read back by deepseek-recipe), thinking gate,
rollback, and rejection of bad constraints."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from deepinfer.sample import InvalidConstraintError, SamplingRow
from deepinfer.sample.grammar import THINK_END_TOKEN_ID
from deepinfer.sampling_params import OutputConstraint, SamplingParams

from sample_schemas import SCHEMAS
from sample_utils import EBNF, TOOLS, VOCAB, generate_random, recipe_tool_calls


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(sampler, tokenizer, i):
    schema = SCHEMAS[i]
    outs = generate_random(sampler, OutputConstraint("json_schema", json.dumps(schema)), seeds=list(range(4)),
                           max_tokens=300, logit_seed=i)
    for ids in outs:
        jsonschema.validate(json.loads(decode(tokenizer, ids)), schema)


def test_json_object(structured, tokenizer):
    """json_object: any JSON object (compact); other top-level values are refused."""
    c = OutputConstraint("json_object")
    st = structured.new_state(c)
    for t in tokenizer.encode('{"a": [1, {"b": null}], "c": "x"}').ids:
        assert st.accept(t)
    assert st.accept(1) and st.is_terminated
    st = structured.new_state(c)
    assert not st.accept(tokenizer.encode("[").ids[0])


def test_regex_full_match(sampler, tokenizer):
    pattern = r"(yes|no) [0-9]{1,3}(\.[0-9]{2})?"
    outs = generate_random(sampler, OutputConstraint("regex", pattern), seeds=list(range(8)))
    for ids in outs:
        assert re.fullmatch(pattern, decode(tokenizer, ids))


def test_ebnf(sampler, tokenizer):
    outs = generate_random(sampler, OutputConstraint("ebnf", EBNF), seeds=list(range(8)), max_tokens=300)
    g = xgr.Grammar.from_ebnf(EBNF)
    for ids in outs:
        text = decode(tokenizer, ids)
        assert re.fullmatch(r"[0-9+\-()]+", text)
        assert text.count("(") == text.count(")")
        eval(text)  # a well-formed arithmetic expression  # noqa: S307


def test_mask_agrees_with_matcher(structured, tokenizer):
    """Walk a schema prefix with the real tokenizer; every probed token the bitmask allows is accepted
    by the matcher and every probed token it forbids is refused."""
    c = OutputConstraint("json_schema", json.dumps(SCHEMAS[0]))
    st = structured.new_state(c)
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    g = torch.Generator().manual_seed(0)
    for tok in tokenizer.encode('{"name": "ab", "age": 1').ids:
        assert st.fill_bitmask(bm, 0)
        probe = torch.randint(0, VOCAB, (40,), generator=g).tolist() + [tok]
        for t in probe:
            allowed = bool((bm[0, t // 32] >> (t % 32)) & 1)
            fork = st.matcher.fork()
            assert fork.accept_token(t) == allowed, (t, tokenizer.id_to_token(t))
        assert st.accept(tok)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}],
                         ids=["required", "named"])
def test_strict_tool_calls_parse_and_validate(sampler, tokenizer, tool_choice):
    _, (kind, spec) = recipe_tool_calls("", TOOLS, tool_choice)
    assert OutputConstraint.from_recipe(kind, spec).tool_choice == "required"
    # the recipe drops maxLength / maxItems from strict schemas; keep ours so that a random model ends
    named = [t for t in TOOLS if t["function"]["name"] in spec]
    c = OutputConstraint("tool_calls", json.dumps(named), tool_choice="required")
    outs = generate_random(sampler, c, seeds=list(range(6)), max_tokens=1500)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for ids in outs:
        choice, _ = recipe_tool_calls(decode(tokenizer, ids), TOOLS, tool_choice)
        calls = choice["message"]["tool_calls"]
        assert calls and choice["finish_reason"] == "tool_calls"
        for call in calls:
            name = call["function"]["name"]
            if isinstance(tool_choice, dict):
                assert name == "set_alarm"
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_tool_calls_auto_walk(structured, tokenizer):
    """auto: free text, then a calls block whose arguments the recipe reads back."""
    _, (kind, spec) = recipe_tool_calls("", TOOLS, "auto")
    c = OutputConstraint.from_recipe(kind, spec)
    assert c.tool_choice == "auto"
    text = ('Let me check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
            '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="unit" string="true">c</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
            '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    st = structured.new_state(c)
    for t in tokenizer.encode(text).ids:
        assert st.accept(t), tokenizer.id_to_token(t)
    assert st.accept(1) and st.is_terminated
    choice, _ = recipe_tool_calls(text, TOOLS, "auto")
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "c", "days": 3}
    # a wrong argument type is refused by the grammar
    st = structured.new_state(c)
    bad = text.replace(">3<", ">9<")
    assert not all(st.accept(t) for t in tokenizer.encode(bad).ids)


def test_after_think_gate_and_rollback(structured, tokenizer):
    c = OutputConstraint("regex", "[0-9]+", after_think=True)
    st = structured.new_state(c)
    bm = xgr.allocate_token_bitmask(1, VOCAB)
    think = tokenizer.encode("I think").ids
    for t in think:
        assert not st.fill_bitmask(bm, 0)        # reasoning is unconstrained
        assert st.accept(t)
    assert st.accept(THINK_END_TOKEN_ID) and st.active
    letter = tokenizer.encode("a").ids[0]
    assert not st.matcher.fork().accept_token(letter)
    digits = tokenizer.encode("42").ids
    for t in digits:
        assert st.accept(t)
    st.rollback(len(digits) + 1)                  # back before </think>: unconstrained again
    assert not st.active
    assert st.accept(letter)                      # still thinking
    assert st.accept(THINK_END_TOKEN_ID)
    for t in digits:
        assert st.accept(t)
    assert st.accept(1) and st.is_terminated


def test_rollback_restores_mask(structured, tokenizer):
    st = structured.new_state(OutputConstraint("json_schema", json.dumps(SCHEMAS[1])))
    a, b = xgr.allocate_token_bitmask(1, VOCAB), xgr.allocate_token_bitmask(1, VOCAB)
    ids = tokenizer.encode('{"color": "red", "ok": true}').ids
    for t in ids[:3]:
        st.accept(t)
    st.fill_bitmask(a, 0)
    for t in ids[3:]:
        assert st.accept(t)
    st.rollback(len(ids) - 3)
    st.fill_bitmask(b, 0)
    assert torch.equal(a, b)


BAD = [
    OutputConstraint("json_schema", "{not json"),
    OutputConstraint("json_schema", '{"type": "objectx"}'),
    OutputConstraint("json_schema", '{"type": "object", "properties": {"a": {"minimum": "zero"}}}'),
    OutputConstraint("json_schema", "[1, 2]"),
    OutputConstraint("regex", "[a-"),
    OutputConstraint("regex", "(a"),
    OutputConstraint("ebnf", "root ::= foo"),
    OutputConstraint("ebnf", "root ::= "),
    OutputConstraint("tool_calls", "[]"),
    OutputConstraint("json_schema", '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'),
    OutputConstraint("json_schema", '{"type": "object", "properties": {"a": {"not": {"const": 1}}}}'),
    OutputConstraint("json_schema", '{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}'),
    OutputConstraint("json_schema", '{"type": "array", "contains": {"const": 1}}'),
    OutputConstraint("json_schema", '{"type": "string", "pattern": "^(?=a)[a-c]+$"}'),
    OutputConstraint("json_schema", '{"$ref": "https://example.com/schema.json"}'),
    OutputConstraint("regex", r"(a)\1"),
    OutputConstraint("regex", r"(?=a)a"),
    OutputConstraint("tool_calls", '[{"type": "function", "function": {"name": "f", "strict": true, '
                                   '"parameters": {"type": "objectx"}}}]'),
]


@pytest.mark.parametrize("c", BAD, ids=[f"{c.kind}:{c.spec[:30]}" for c in BAD])
def test_bad_constraints_rejected_at_admission(sampler, c):
    with pytest.raises(InvalidConstraintError) as e:
        sampler.new_state(SamplingParams(constraint=c))
    assert isinstance(e.value, ValueError)
    assert "/project/cpp" not in str(e.value) and str(e.value)
    # the sampler keeps serving
    st = sampler.new_state(SamplingParams(temperature=0, constraint=OutputConstraint("regex", "ok")))
    out = sampler.sample(torch.zeros(1, VOCAB), [SamplingRow(st, (), 0)])
    assert out.token_ids.item() != 1


def test_compiled_grammars_are_cached(structured):
    c = OutputConstraint("json_schema", json.dumps(SCHEMAS[2]))
    assert structured.compile(c) is structured.compile(c)


def test_new_state_replays_outputs_after_preemption(sampler, tokenizer):
    params = SamplingParams(constraint=OutputConstraint("json_schema", json.dumps(SCHEMAS[1])), seed=5)
    ids = tokenizer.encode('{"color": "gr').ids
    live = sampler.new_state(params)
    for t in ids:
        live.grammar.accept(t)
    resumed = sampler.new_state(params, ids)
    a, b = xgr.allocate_token_bitmask(1, VOCAB), xgr.allocate_token_bitmask(1, VOCAB)
    live.grammar.fill_bitmask(a, 0)
    resumed.grammar.fill_bitmask(b, 0)
    assert torch.equal(a, b) and resumed.seed == live.seed == 5
    sampler.check(params)
    with pytest.raises(InvalidConstraintError):
        sampler.check(SamplingParams(constraint=OutputConstraint("regex", "(")))


def test_draft_rows_get_masks_after_their_lookahead(sampler, tokenizer):
    """Verification of drafts d1..d3: row j's mask is the grammar's after d1..dj; the state is
    unchanged by sampling (advance=False) and then advanced by the accepted tokens."""
    params = SamplingParams(temperature=0, constraint=OutputConstraint("json_schema", json.dumps(SCHEMAS[1])))
    drafts = tokenizer.encode('{"color": "').ids[:3]
    state = sampler.new_state(params)
    rows = [SamplingRow(state, (), 10 + j, lookahead=drafts[:j]) for j in range(4)]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)
    out = sampler.sample(logits, rows, advance=False)
    ref = sampler.new_state(params)
    for j in range(4):   # the same row computed step by step
        step = sampler.sample(logits[j:j + 1], [SamplingRow(ref, drafts[:j], 10 + j)], advance=False)
        assert step.token_ids[0] == out.token_ids[j]
        ref.accept([drafts[j]] if j < 3 else [])
    assert not state.grammar._history           # nothing advanced
    state.accept(drafts[:2] + [int(out.token_ids[2])])
    assert len(state.grammar._history) == 3


def test_keyword_names_as_property_names_are_fine(structured):
    """'not' / 'if' as *property names* (or inside enum data) are not the unenforced keywords."""
    schema = {"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"enum": [{"not": 1}]}},
              "required": ["not", "if"], "additionalProperties": False}
    structured.compile(OutputConstraint("json_schema", json.dumps(schema)))
