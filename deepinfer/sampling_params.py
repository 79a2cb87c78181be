"""What a caller asks of generation: vLLM's SamplingParams, which our users know, plus our constraint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class OutputConstraint:
    """Grammar the output must follow (the recipe's OutputConstraint kinds), enforced by token masks.

    kind: json_object | json_schema | regex | ebnf | tool_calls (strict tool-call grammar).
    spec: the schema (JSON string), regex, EBNF text, or for tool_calls a JSON list of tools.
    after_think: in thinking mode the constraint starts after `</think>`.
    tool_choice (tool_calls only): "auto" = text, then optionally one DSML calls block;
      "required" = the prompt already ends with `<｜DSML｜ calls>\\n` (the recipe's
      starts_in_tool_calls) and the output is one or more invokes, then the closing tag. A named
      tool_choice is "required" with only that tool in spec.
    Compiled and validated at admission by deepinfer.sample; a bad one raises
    deepinfer.sample.InvalidConstraintError (a ValueError; the serving layer answers 400).
    """

    kind: Literal["json_object", "json_schema", "regex", "ebnf", "tool_calls"]
    spec: str = ""
    after_think: bool = False
    tool_choice: Literal["auto", "required"] = "auto"

    @classmethod
    def from_recipe(cls, kind: str, schema: str, after_think: bool = False) -> "OutputConstraint":
        """deepseek-recipe's InferenceOptions.output_constraint (kind, schema) -> ours.

        json + "" -> json_object, json + schema -> json_schema, regex, tool_call -> tool_calls auto,
        tool_call_required (required or named tool_choice) -> tool_calls required.
        """
        if kind == "json":
            return cls("json_schema" if schema else "json_object", schema, after_think)
        if kind == "regex":
            return cls("regex", schema, after_think)
        if kind in ("tool_call", "tool_call_required"):
            choice = "required" if kind == "tool_call_required" else "auto"
            return cls("tool_calls", schema, after_think, tool_choice=choice)
        raise ValueError(f"unknown recipe output constraint kind {kind!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                     # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None            # the random stream depends only on (seed, position)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None        # None = off; 0 = the sampled token's logprob only; up to 20 alternatives
    constraint: OutputConstraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
