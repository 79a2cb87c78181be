"""Structured output with xgrammar: OutputConstraint -> compiled grammar (cached) -> matcher per request.

    admission:  StructuredOutput.compile(constraint)  -> CompiledGrammar   (InvalidConstraintError = 400)
                GrammarState(compiled, ...)            one per request
    each step:  GrammarState.fill_bitmask(bitmask, row) -> the sampler masks the logits row
                GrammarState.accept(token) / rollback(k)   (drafts rejected by verification)

The vocabulary is the checkpoint's tokenizer.json (byte-level BPE) at the model's vocab width, so a
bitmask row matches a logits row. Added tokens are blanked for the grammar (never allowed inside
constrained text) except EOS, the stop token, and `｜DSML｜`, which the tool-call grammar spells.

In thinking mode (constraint.after_think) the matcher is idle until the `</think>` token (id
128822; a `</think>` spelled from smaller tokens does not open the gate): the reasoning is
unconstrained and costs no mask work.

JSON (json_object, json_schema) is compact: `", "` and `": "` separators, no other whitespace. A
model that would pretty-print is kept on one line, and no model can spend its budget on endless
whitespace between values (a random-weight one would). Schema features xgrammar accepts but does not
enforce are refused (UNENFORCED_KEYWORDS), so every accepted schema is really enforced.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from deepinfer.request import InvalidRequestError
from deepinfer.sample.tool_grammar import parse_tools, tool_call_structural_tag
from deepinfer.sampling_params import OutputConstraint

EOS_TOKEN_ID = 1
THINK_END_TOKEN_ID = 128822   # </think>
GRAMMAR_TEXT_TOKENS = {"｜DSML｜"}
BLANKED_TEXT_TOKENS = {"<think>", "</think>"}


class InvalidConstraintError(InvalidRequestError):
    """The request's output constraint cannot be enforced (bad JSON schema, regex or grammar).
    Raised at admission, before any generation; the serving layer answers with a 400."""


def load_tokenizer_info(tokenizer_path: str, vocab_size: int, stop_token_ids=(EOS_TOKEN_ID,)) -> xgr.TokenizerInfo:
    """tokenizer.json (HF tokenizers, byte-level BPE) -> xgrammar TokenizerInfo of width vocab_size."""
    import tokenizers

    with open(tokenizer_path, encoding="utf-8") as f:
        added = json.load(f).get("added_tokens", [])
    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    encoded = [""] * vocab_size   # "" = never produced by a grammar (padding rows, special tokens)
    for text, idx in tok.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size:
            encoded[idx] = text
    for a in added:
        keep = a["content"] in GRAMMAR_TEXT_TOKENS or (not a["special"] and a["content"] not in BLANKED_TEXT_TOKENS)
        if a["id"] < vocab_size and not keep and a["id"] not in stop_token_ids:
            encoded[a["id"]] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids), add_prefix_space=meta["add_prefix_space"])


def _clean(err: Exception) -> str:
    """xgrammar's messages carry a timestamp and a C++ source location; keep the message."""
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(err)).strip()


# Keywords xgrammar accepts but does not enforce (measured: random generations violate them), so a
# request using them would get output that fails its own schema: refuse it instead (a 400).
UNENFORCED_KEYWORDS = {"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                       "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef"}
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCHEMA_ONE = {"items", "additionalProperties", "propertyNames", "additionalItems", "unevaluatedProperties",
               "unevaluatedItems"}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def unenforced_feature(schema, path: str = "#") -> str | None:
    """The first schema feature the grammar cannot enforce, as 'keyword at path', or None."""
    if not isinstance(schema, dict):
        return None
    for key, val in schema.items():
        where = f"{path}/{key}"
        if key in UNENFORCED_KEYWORDS or (key == "uniqueItems" and val is True):
            return f"'{key}' at {where}"
        if key == "$ref" and isinstance(val, str) and not val.startswith("#"):
            return f"remote '$ref' {val!r} at {where}"
        if key == "pattern" and isinstance(val, str) and _LOOKAROUND.search(val):
            return f"lookaround in 'pattern' at {where}"
        subs = (val.items() if key in _SCHEMA_MAPS and isinstance(val, dict) else
                enumerate(val) if (key in _SCHEMA_LISTS or key in _SCHEMA_ONE) and isinstance(val, list) else
                [("", val)] if key in _SCHEMA_ONE else [])
        for name, sub in subs:
            found = unenforced_feature(sub, f"{where}/{name}" if name != "" else where)
            if found:
                return found
    return None


def _check_json_schema(spec: str, what: str = "json_schema") -> dict | bool:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise InvalidConstraintError(f"{what}: the schema is not valid JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidConstraintError(f"{what}: a schema must be a JSON object or boolean")
    found = unenforced_feature(schema)
    if found:
        raise InvalidConstraintError(f"{what}: {found} is not supported (structured output cannot enforce it)")
    try:
        import jsonschema
    except ImportError:  # the metaschema check is extra; xgrammar still rejects what it cannot convert
        return schema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidConstraintError(f"{what}: invalid JSON schema: {e.message}") from None
    return schema


class StructuredOutput:
    """Compiles constraints for one tokenizer; compiled grammars are cached by (kind, spec, tool_choice)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_threads: int = 2, max_cached: int = 512) -> None:
        self.tokenizer_info = tokenizer_info
        self.compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer_file(cls, tokenizer_path: str, vocab_size: int, **kw) -> "StructuredOutput":
        return cls(load_tokenizer_info(tokenizer_path, vocab_size), **kw)

    def compile(self, c: OutputConstraint) -> xgr.CompiledGrammar:
        key = (c.kind, c.spec, c.tool_choice)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(c)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: OutputConstraint) -> xgr.CompiledGrammar:
        try:
            if c.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "json_schema":
                _check_json_schema(c.spec)
                return self.compiler.compile_json_schema(c.spec, any_whitespace=False)
            if c.kind == "regex":
                return self.compiler.compile_regex(c.spec)
            if c.kind == "ebnf":
                return self.compiler.compile_grammar(c.spec)
            if c.kind == "tool_calls":
                tools = parse_tools(c.spec)
                for t in tools:
                    if t["strict"]:
                        _check_json_schema(json.dumps(t["parameters"]), f"tool {t['name']!r} parameters")
                return self.compiler.compile_structural_tag(tool_call_structural_tag(tools, c.tool_choice))
        except InvalidConstraintError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidConstraintError(f"{c.kind}: {_clean(e)}") from None
        raise InvalidConstraintError(f"unknown constraint kind {c.kind!r}")

    def new_state(self, c: OutputConstraint, stop_token_ids: list[int] = ()) -> "GrammarState":
        return GrammarState(self.compile(c), after_think=c.after_think,
                            stop_token_ids=[EOS_TOKEN_ID, *stop_token_ids])


class GrammarState:
    """One request's matcher, plus the thinking gate, with a history for rollback.

    history[i] is True when output token i went through the matcher (after `</think>`).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, after_think: bool = False,
                 stop_token_ids: list[int] = (EOS_TOKEN_ID,), think_end_id: int = THINK_END_TOKEN_ID) -> None:
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(dict.fromkeys(stop_token_ids)))
        self.think_end_id = think_end_id
        self._start = None if after_think else 0   # index in history where the constraint began
        self._history: list[bool] = []

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return self._start is not None and not self.matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask, row: int, lookahead=()) -> bool:
        """Write the allowed-token mask of the next token into bitmask[row]; False when unconstrained.
        lookahead: tokens to accept first, tentatively (draft verification), rolled back after."""
        n = 0
        for t in lookahead:
            if not self.accept(int(t)):
                break   # a draft the grammar refuses: verification rejects it anyway
            n += 1
        filled = self.active
        if filled:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        self.rollback(n)
        return filled

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token. False if the grammar refuses it (state unchanged)."""
        if self._start is None:
            if token_id == self.think_end_id:
                self._start = len(self._history) + 1
            self._history.append(False)
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token_id)):
            return False
        self._history.append(True)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted tokens (rejected drafts, or a replayed suffix)."""
        if num_tokens <= 0:
            return
        dropped = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        n = sum(dropped)
        if n:
            self.matcher.rollback(n)
        if self._start is not None and len(self._history) < self._start:
            self._start = None
