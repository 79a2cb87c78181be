"""The V4.1 DSML tool-call grammar, as an xgrammar structural tag.

The format is what deepseek-recipe 0.2.0 renders and its stream parser reads back (RECIPE.md 1.2,
2.1, 3):

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

xgrammar's `deepseek_v4_1_xml` JSON-schema style writes the parameter lines (string values raw,
others as JSON), so each tool's arguments follow its schema. What differs from xgrammar's builtin
`deepseek_v4_1` tag is where the output starts:

    tool_choice auto:      free text (no <think>/</think>), then optionally ONE calls block; the
                           block is entered when the text reaches `<｜DSML｜ calls>`
    tool_choice required:  the recipe's prompt already ends `</think>\\n\\n<｜DSML｜ calls>\\n`
                           (ParsingOptions.starts_in_tool_calls), so the output starts at the first
                           invoke: one or more invokes, then `</｜DSML｜ calls>`. A named
                           tool_choice is `required` with only that tool listed (the recipe filters).

Whitespace between parameter lines is at most one character (the canonical `\n`): unbounded
whitespace there lets a model idle forever. Arguments are schema-constrained for tools with `strict: true`; other tools get the DSML structure
with any JSON-object arguments (OpenAI's meaning of non-strict), so a schema we cannot enforce is
never a reason to refuse a non-strict request.
"""

from __future__ import annotations

import json
from typing import Any

from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    JSONSchemaFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

CALLS_BEGIN = "<｜DSML｜ calls>"
CALLS_END = "</｜DSML｜ calls>"
INVOKE_PREFIX = '<｜DSML｜ invoke name="'
INVOKE_SUFFIX = '">\n'
INVOKE_END = "</｜DSML｜ invoke>\n"
THINK_TOKENS = ["<think>", "</think>"]


def parse_tools(spec: str) -> list[dict[str, Any]]:
    """The constraint's spec -> [{"name", "parameters", "strict"}]. Accepts the recipe's list of
    `{"type": "function", "function": {...}}` and bare function objects. Raises ValueError."""
    try:
        tools = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"tool_calls constraint: the tool list is not valid JSON ({e})") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError("tool_calls constraint: expected a non-empty JSON list of tools")
    out = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or any(c in name for c in '"<>\n'):
            raise ValueError(f"tool_calls constraint: invalid tool name {name!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tool {name!r}: parameters must be a JSON object schema")
        out.append({"name": name, "parameters": params, "strict": fn.get("strict") is True})
    return out


def _invoke_tag(tool: dict[str, Any]) -> TagFormat:
    schema = tool["parameters"] if tool["strict"] else {"type": "object"}
    return TagFormat(
        begin=INVOKE_PREFIX + tool["name"] + INVOKE_SUFFIX,
        content=JSONSchemaFormat(json_schema=schema, style="deepseek_v4_1_xml", max_whitespace_cnt=1),
        end=INVOKE_END,
    )


def tool_call_structural_tag(tools: list[dict[str, Any]], tool_choice: str) -> StructuralTag:
    invokes = TagsWithSeparatorFormat(tags=[_invoke_tag(t) for t in tools], separator="", at_least_one=True)
    if tool_choice == "required":
        return StructuralTag(format=SequenceFormat(elements=[invokes, ConstStringFormat(value=CALLS_END)]))
    if tool_choice != "auto":
        raise ValueError(f"tool_choice must be 'auto' or 'required', got {tool_choice!r}")
    block = TagFormat(begin=CALLS_BEGIN + "\n", content=invokes, end=CALLS_END)
    return StructuralTag(format=TriggeredTagsFormat(
        triggers=[CALLS_BEGIN], tags=[block], excludes=THINK_TOKENS, stop_after_first=True))


def no_tools_structural_tag() -> StructuralTag:
    """Free text in which no calls block may start (tool_choice none with tools declared)."""
    return StructuralTag(format=AnyTextFormat(excludes=THINK_TOKENS + [CALLS_BEGIN]))
