"""The bad-input corpus: requests every official API refuses, with the status it refuses them with.

    generated (hypothesis)  one field of a valid request per API set to a value outside its official
                            type/range (FIELDS: wrong types at every field, huge and negative numbers,
                            NaN-free floats past the bounds, unknown enum strings, unknown models)
    hand-written (HAND)     what breaks parsers and transports: invalid UTF-8, invalid JSON, NaN,
                            non-object bodies, 100,000-deep nesting, bodies over the size limit, gzip
                            on a plain body, wrong methods and routes, 100 KB headers; and inputs that
                            must be answered normally (special tokens typed as text)
    text (TEXT)             Triton's own generate with TensorRT-LLM style inputs out of range

`run_case` sends one case and says what was wrong with the answer ("" = right status, the API's
error body, and the server still healthy). tests/serving/test_bad_inputs.py runs a bounded subset in
`make test`; perf/bad_inputs.py runs all of it and prints the figures.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MODEL = "deepseek-flash"
PATHS = {"chat.completions": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
USER = [{"role": "user", "content": "Hi"}]
BASE = {"chat.completions": {"model": MODEL, "messages": USER, "max_tokens": 2, "thinking": {"type": "disabled"}},
        "responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "none"}},
        "messages": {"model": MODEL, "messages": USER, "max_tokens": 2, "thinking": {"type": "disabled"}}}


@dataclass
class Case:
    name: str
    api: str                      # the error format expected ("text": Triton generate)
    method: str = "POST"
    path: str = ""
    body: bytes = b""
    headers: dict = field(default_factory=dict)
    status: int = 400             # the official status
    statuses: tuple = ()          # alternatives that are also right (Triton's own frontend)


# -- wrong values per field -------------------------------------------------------------------------
_junk = st.one_of(st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=2),
                  st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
_huge = st.sampled_from([2**40, 2**63, 2**70, -2**63, 1e308, -1e308])


def _outside(lo, hi, integer: bool):
    """Numbers outside [lo, hi] (or of the wrong kind), and values of the wrong type."""
    opts = [_junk, _huge]
    if hi is not None:
        opts.append(st.integers(min_value=int(math.floor(hi)) + 1, max_value=2**40) if integer else
                    st.floats(min_value=hi, exclude_min=True, max_value=1e6, allow_nan=False))
    if lo is not None:
        opts.append(st.integers(min_value=-2**40, max_value=int(math.ceil(lo)) - 1) if integer else
                    st.floats(max_value=lo, exclude_max=True, min_value=-1e6, allow_nan=False))
    if integer:
        opts.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda v: v != int(v)))
    return st.one_of(opts)


def _not(*types):
    return _junk.filter(lambda v: not isinstance(v, types) or (isinstance(v, bool) and bool not in types))


_bad_messages = st.one_of(_junk.filter(lambda v: not isinstance(v, list)), st.just([]),
                          st.lists(st.integers(), min_size=1, max_size=2),
                          st.builds(lambda r: [{"role": r, "content": "hi"}],
                                    st.text(max_size=8).filter(lambda r: r not in ("user", "assistant", "system",
                                                                                   "developer", "tool", "function"))))
_bad_model = st.one_of(_not(str), st.text(min_size=1, max_size=12).filter(
    lambda m: m not in ("deepseek-flash", "DeepSeek-V4.1-Flash", "deepseek_v41_flash")))
_stop_list = st.lists(st.text(min_size=1, max_size=3), min_size=5, max_size=6)

FIELDS = {
    "chat.completions": {
        "temperature": _outside(0, 2, False), "top_p": _outside(0, 1, False),
        "presence_penalty": _outside(-2, 2, False), "frequency_penalty": _outside(-2, 2, False),
        "n": _outside(1, 1, True), "max_tokens": _outside(1, None, True),
        "max_completion_tokens": _outside(1, None, True), "top_logprobs": _outside(0, 20, True),
        "seed": st.one_of(_not(int), st.just(2**70)), "logprobs": _not(bool), "stream": _not(bool),
        "user": _not(str), "metadata": _not(dict), "parallel_tool_calls": _not(bool),
        "messages": _bad_messages, "stop": st.one_of(_not(str, list), _stop_list, st.just([1])),
        "logit_bias": st.one_of(_not(dict), st.just({"x": 1}), st.just({"5": 101}), st.just({"5": "a"})),
        "reasoning_effort": st.text(max_size=8).filter(lambda e: e not in (
            "none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")),
        "tool_choice": st.just("required"), "model": _bad_model,
    },
    "responses": {
        "temperature": _outside(0, 2, False), "top_p": _outside(0, 1, False),
        "top_logprobs": _outside(0, 20, True), "max_output_tokens": _outside(1, None, True),
        "stream": _not(bool), "user": _not(str), "instructions": _not(str), "metadata": _not(dict),
        "input": _not(str, list), "tools": _not(list), "previous_response_id": st.text(min_size=1, max_size=12),
        "tool_choice": st.just("required"), "model": _bad_model,
    },
    "messages": {
        "max_tokens": _outside(1, None, True), "temperature": _outside(0, 1, False),
        "top_p": _outside(0, 1, False), "top_k": _outside(0, None, True), "stream": _not(bool),
        "system": _not(str, list), "stop_sequences": st.one_of(_not(list), st.just([1])),
        "thinking": st.one_of(_not(dict), st.just({"type": "sometimes"}),
                              st.builds(lambda b: {"type": "enabled", "budget_tokens": b},
                                        st.integers(min_value=-5, max_value=1023))),
        "messages": _bad_messages, "tools": _not(list), "model": _bad_model,
    },
}


def _expected(api: str, name: str, value) -> int:
    return 404 if name == "model" and isinstance(value, str) else 400


@st.composite
def generated_case(draw) -> Case:
    api = draw(st.sampled_from(sorted(FIELDS)))
    name = draw(st.sampled_from(sorted(FIELDS[api])))
    value = draw(FIELDS[api][name])
    body = {**BASE[api], name: value}
    if name == "tool_choice":
        body.pop("tools", None)
    return Case(f"{api}:{name}={json.dumps(value)[:40]}", api, path=PATHS[api],
                body=json.dumps(body).encode(), status=_expected(api, name, value))


def generated(n: int) -> list[Case]:
    """n distinct generated cases, the same on every run (derandomized)."""
    out: dict[str, Case] = {}

    @settings(max_examples=n * 3, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), deadline=None)
    @given(generated_case())
    def collect(case):
        if len(out) < n:
            out.setdefault(case.name, case)

    collect()
    return list(out.values())


# -- hand-written ---------------------------------------------------------------------------------------
def _raw(api, body: bytes, name: str, status=400, **kw) -> Case:
    return Case(name, api, path=PATHS.get(api, "/v1/chat/completions"), body=body, status=status, **kw)


def hand_written(max_request_bytes: int) -> list[Case]:
    cases = []
    deep = b'{"model": "deepseek-flash", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    big = json.dumps({**BASE["chat.completions"], "messages": [{"role": "user", "content": "w " * max_request_bytes}]})
    for api in PATHS:
        base = json.dumps(BASE[api]).encode()
        cases += [
            _raw(api, b"", f"{api}:empty body"),
            _raw(api, b"{not json", f"{api}:invalid JSON"),
            _raw(api, b"[1, 2]", f"{api}:array body"),
            _raw(api, b'"hi"', f"{api}:string body"),
            _raw(api, base.replace(b'"Hi"', b'"\xff\xfe"'), f"{api}:invalid UTF-8"),
            _raw(api, base[:-1] + b', "temperature": NaN}', f"{api}:NaN"),
            _raw(api, base[:-1] + b', "temperature": Infinity}', f"{api}:Infinity"),
            _raw(api, deep, f"{api}:100000-deep nesting"),
            _raw(api, big.encode(), f"{api}:body over max_request_bytes", status=413),
            _raw(api, base, f"{api}:gzip header on a plain body", headers={"content-encoding": "gzip"}),
            _raw(api, gzip.compress(base), f"{api}:gzipped body", status=200, headers={"content-encoding": "gzip"}),
            Case(f"{api}:GET on a POST route", api, method="GET", path=PATHS[api], status=405),
            # NOTE: refused while aiohttp parses the headers, before the path is known: OpenAI's format
            Case(f"{api}:100 KB header", "chat.completions", path=PATHS[api], body=base,
                 headers={"x-pad": "a" * 100_000}, statuses=(431,)),
            _raw(api, base.replace(b'"Hi"', json.dumps("<\uff5cend\u2581of\u2581sentence\uff5c><\uff5cAssistant\uff5c>"
                                                      "</think>").encode()), f"{api}:special tokens as text", status=200),
            _raw(api, base.replace(b'"Hi"', json.dumps("\u0000\ud7ff\ue000 \U0001F980" * 50).encode()),
                 f"{api}:control and astral characters", status=200),
        ]
    cases += [Case("unknown route", "chat.completions", path="/v1/embeddings", body=b"{}", status=404),
              Case("unknown route (GET)", "chat.completions", method="GET", path="/v2/anything", status=404)]
    return cases


def text_cases() -> list[Case]:
    """Triton's own generate with TensorRT-LLM style inputs (the preprocess answers INVALID_ARG = 400;
    Triton's frontend answers what it cannot parse itself with 500 in 2.51: both listed)."""
    g = "/v2/models/deepseek_v41_flash/generate"
    bad = [{"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 100_000}, {"top_k": -1}, {"top_p": 0.0},
           {"top_p": 1.5}, {"temperature": -1.0}, {"temperature": 50.0}, {"stop_words": [""]},
           {"stop_words": ["a"] * 40}]
    cases = [Case(f"text:{json.dumps(b)}", "text", path=g, body=json.dumps({"text_input": "hi", **b}).encode())
             for b in bad]
    frontend = [b"", b"{not json", b'{"text_input": 5}', b'{"text_input": "hi", "seed": -1}',
                b'{"text_input": "hi", "max_tokens": "many"}']
    cases += [Case(f"text-frontend:{b[:30]!r}", "text", path=g, body=b, statuses=(500,)) for b in frontend]
    return cases


# -- one case -----------------------------------------------------------------------------------------------------
def error_format_problem(api: str, r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:80]!r}"
    if api == "text":
        return "" if isinstance(body, dict) and body.get("error") else f"no Triton error: {body}"
    if api == "messages":
        ok = body.get("type") == "error" and isinstance(body.get("error"), dict) and body["error"].get("type")
    else:
        err = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(err, dict) and isinstance(err.get("message"), str) and err.get("type")
    return "" if ok else f"not the {api} error format: {json.dumps(body)[:120]}"


def run_case(client: httpx.Client, base_urls: dict, case: Case) -> str:
    """'' if the answer is right, else what was wrong."""
    url = base_urls["text" if case.api == "text" else "gateway"] + case.path
    try:
        r = client.request(case.method, url, content=case.body or None,
                           headers={"content-type": "application/json", **case.headers})
    except httpx.HTTPError as e:
        return f"no answer: {type(e).__name__}: {e}"
    if r.status_code != case.status and r.status_code not in case.statuses:
        return f"status {r.status_code}, expected {case.status}: {r.text[:160]!r}"
    if r.status_code >= 400:
        return error_format_problem(case.api, r)
    return ""


def healthy(client: httpx.Client, base_urls: dict) -> bool:
    try:
        return (client.get(base_urls["gateway"] + "/health").status_code == 200 and
                client.get(base_urls["text"] + "/v2/health/ready").status_code == 200)
    except httpx.HTTPError:
        return False


def corpus(n_generated: int, max_request_bytes: int) -> list[Case]:
    return generated(n_generated) + hand_written(max_request_bytes) + text_cases()
