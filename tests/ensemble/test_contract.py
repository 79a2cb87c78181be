"""Every config.pbtxt matches ensemble/contract.py; the contract obeys Triton's decoupled-ensemble
rules; the recipe and engine driver speak the contract's names."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.ensemble import config
from deepinfer.ensemble import contract as c
from deepinfer.ensemble.engine_driver import _Active, EngineRequest

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def test_no_drift():
    assert config.check(REPO) == [], "run: python -m deepinfer.ensemble.config --write"


def test_drift_is_detected(tmp_path):
    config.write(tmp_path)
    assert config.check(tmp_path) == []
    path = tmp_path / c.ENGINE / "config.pbtxt"
    path.write_text(path.read_text().replace('"output_ids"', '"output_tokens"'))
    assert config.check(tmp_path) == [str(path)]


def test_every_wired_input_is_produced_upstream():
    produced = {t.wire for t in c.TABLE if t.io == c.OUT} | {t.wire for t in c.ensemble_inputs()}
    for t in c.TABLE:
        if t.io == c.IN and t.wire:
            assert t.wire in produced, t


def test_postprocess_reads_only_engine_outputs():
    """The decoupled rule: the postprocess cannot take inputs from before the engine."""
    engine_out = {t.wire for t in c.tensors(c.ENGINE, c.OUT)}
    assert {t.wire for t in c.tensors(c.POSTPROCESS, c.IN)} <= engine_out


def test_api_tensors():
    ins = {t.name: t for t in c.ensemble_inputs()}
    outs = {t.name: t for t in c.ensemble_outputs()}
    assert ins["request"].dtype == ins["api"].dtype == c.BYTES
    assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "stop_words",
            "exclude_input_in_output"} <= set(ins)
    assert {"response", "text_output", "num_input_tokens", "num_output_tokens", "finish_reason"} <= set(outs)


def test_runtime_repository_adds_deployment_values(tmp_path):
    repo = config.build_runtime_repository(tmp_path / "r", {c.ENGINE: {"checkpoint": "/ckpt"}}, REPO,
                                           execution_env="/venv")
    text = (repo / c.ENGINE / "config.pbtxt").read_text()
    assert 'key: "checkpoint" value: { string_value: "/ckpt" }' in text
    assert 'key: "EXECUTION_ENV_PATH" value: { string_value: "/venv" }' in text
    assert (repo / c.ENGINE / "1" / "model.py").resolve() == (REPO / c.ENGINE / "1" / "model.py").resolve()
    assert "EXECUTION_ENV_PATH" not in (REPO / c.ENGINE / "config.pbtxt").read_text()   # committed: portable


def test_recipe_and_driver_use_contract_names(tokenizer_path):
    from deepinfer.recipe import Postprocessor, Preprocessor, prepare_inputs, preprocess_outputs
    pre = Preprocessor(tokenizer_path, 4096)
    prepared = prepare_inputs(pre, {"text_input": "hi"})
    assert set(preprocess_outputs(prepared)) == set(c.names(c.PREPROCESS, c.OUT))
    engine_out = _Active(EngineRequest("k"), sender=None).outputs([], None, None, 0, 0)
    assert set(engine_out) == set(c.names(c.ENGINE, c.OUT))
    out, _ = Postprocessor(tokenizer_path).process({**engine_out, "context": prepared.context.to_json()})
    assert set(out) == set(c.names(c.POSTPROCESS, c.OUT))
