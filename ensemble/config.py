"""Writes and checks every config.pbtxt of the model repository from contract.py.

    python -m deepinfer.ensemble.config --check [--repo model_repository]   # exit 1 on drift
    python -m deepinfer.ensemble.config --write [--repo model_repository]

`build_runtime_repository` renders the same configs with deployment values (checkpoint, engine
arguments, EXECUTION_ENV_PATH) into another folder whose model.py files link to the committed ones;
the launcher (serve.py) and the tests serve from it, so the committed configs stay portable (no
paths of this machine, nothing specific to Triton 2.51).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import contract as c

HEADER = "# Generated from ensemble/contract.py by `python -m deepinfer.ensemble.config --write`; do not edit.\n"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPO = REPO_ROOT / "model_repository"


def _tensor_block(kind: str, ts: list[c.Tensor]) -> str:
    items = []
    for t in ts:
        dims = ", ".join(str(d) for d in t.dims)
        opt = "\n    optional: true" if t.optional and kind == "input" else ""
        items.append(f'  {{\n    name: "{t.name}"\n    data_type: {t.dtype}\n    dims: [ {dims} ]{opt}\n  }}')
    return f"{kind} [\n" + ",\n".join(items) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(f'parameters: {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}\n'
                   for k, v in params.items())


def render(model: str, overrides: dict[str, str] | None = None) -> str:
    """config.pbtxt text of one model; overrides replace or add parameters (EXECUTION_ENV_PATH...)."""
    if model == c.ENSEMBLE:
        return render_ensemble()
    s = c.SETTINGS[model]
    params = dict(s.parameters) | dict(overrides or {})
    text = HEADER + f'name: "{model}"\nbackend: "python"\nmax_batch_size: 0\n'
    text += _tensor_block("input", c.tensors(model, c.IN)) + _tensor_block("output", c.tensors(model, c.OUT))
    if s.note:
        text += f"# {s.note}\n"
    text += f"instance_group [ {{ count: {s.instances} kind: KIND_CPU }} ]\n"
    if s.decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    return text + _parameters(params)


def render_ensemble() -> str:
    text = HEADER + f'name: "{c.ENSEMBLE}"\nplatform: "ensemble"\nmax_batch_size: 0\n'
    text += _tensor_block("input", c.ensemble_inputs()) + _tensor_block("output", c.ensemble_outputs())
    steps = []
    for model in c.COMPOSING:
        maps = [f'      input_map {{ key: "{t.name}" value: "{t.wire}" }}' for t in c.tensors(model, c.IN) if t.wire]
        maps += [f'      output_map {{ key: "{t.name}" value: "{t.wire}" }}' for t in c.tensors(model, c.OUT)]
        steps.append(f'    {{\n      model_name: "{model}"\n      model_version: -1\n' + "\n".join(maps) + "\n    }")
    return text + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n"


ALL_MODELS = (*c.COMPOSING, c.ENSEMBLE)


def write(repo: Path = DEFAULT_REPO) -> None:
    for model in ALL_MODELS:
        (repo / model / "1").mkdir(parents=True, exist_ok=True)
        (repo / model / "config.pbtxt").write_text(render(model))


def check(repo: Path = DEFAULT_REPO) -> list[str]:
    """Names of the config.pbtxt files that differ from the contract (empty = no drift)."""
    drift = []
    for model in ALL_MODELS:
        path = repo / model / "config.pbtxt"
        if not path.is_file() or path.read_text() != render(model):
            drift.append(str(path))
    return drift


def build_runtime_repository(dest: Path, parameters: dict[str, dict[str, str]], source: Path = DEFAULT_REPO,
                             execution_env: str | None = None) -> Path:
    """Render the repository into dest with per-model parameter overrides; model.py files are linked."""
    dest.mkdir(parents=True, exist_ok=True)
    for model in ALL_MODELS:
        version = dest / model / "1"
        version.mkdir(parents=True, exist_ok=True)
        overrides = dict(parameters.get(model, {}))
        if execution_env and model != c.ENSEMBLE:
            overrides["EXECUTION_ENV_PATH"] = execution_env
        (dest / model / "config.pbtxt").write_text(render(model, overrides))
        src = source / model / "1" / "model.py"
        link = version / "model.py"
        if src.is_file():
            if link.is_symlink() or link.exists():
                link.unlink()
            os.symlink(src.resolve(), link)
    return dest


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt parameters from a Python-backend model config (args["model_config"] JSON)."""
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


def resolve_checkpoint(value: str) -> str:
    """The `checkpoint` parameter, else $DEEPINFER_CHECKPOINT, else <repo>/checkpoints/tiny."""
    if value:
        return value
    return os.environ.get("DEEPINFER_CHECKPOINT") or str(REPO_ROOT / "checkpoints" / "tiny")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=DEFAULT_REPO)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    if args.write:
        write(args.repo)
        return 0
    drift = check(args.repo)
    for path in drift:
        print(f"drift: {path} differs from ensemble/contract.py (run --write)", file=sys.stderr)
    return 1 if drift else 0


if __name__ == "__main__":
    sys.exit(main())
