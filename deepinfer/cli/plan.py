"""deepinfer-plan: will the model fit these GPUs? Per-rank weights, KV cache capacity, a verdict.

    deepinfer-plan [--config PATH] --gpus 8 --gpu-memory 141GB [--engram device|sharded|host]
                   [--redundant-experts N] [--max-model-len 65536] [--max-num-seqs 64]

Exit status: 0 fits, 1 does not fit, 2 bad input. Sizes: 141GB / 141G (10^9), 141GiB / 141Gi (2^30),
likewise K/M/T; a bare number is bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
          "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str) -> int:
    """'141GB' -> 141e9 bytes, '141GiB' -> 141 * 2^30, '80G' -> 80e9 (decimal unless 'i')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise ValueError(f"size {text!r} is not a number with a unit like 141GB, 141GiB or 80G")
    return int(float(m.group(1)) * _UNITS[unit])


def read_model_args(path: str | Path):
    """ModelArgs from an HF config.json file or a folder holding one."""
    from deepinfer.model.args import ConfigError, ModelArgs
    path = Path(path)
    if path.is_dir():
        return ModelArgs.from_checkpoint(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config.json file or folder")
    try:
        return ModelArgs.from_hf_config(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _parser() -> argparse.ArgumentParser:
    from deepinfer.parallel.planner import DEFAULT_RESERVE_BYTES, ENGRAM_PLACEMENTS
    p = argparse.ArgumentParser(prog="deepinfer-plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="HF config.json or a folder with one (default: the shipped "
                                    "DeepSeek-V4.1-Flash release config)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs = EP ranks = attention DP ranks (default 8)")
    p.add_argument("--gpu-memory", default="141GB", help="memory per GPU, e.g. 141GB, 141GiB, 80G (default 141GB)")
    p.add_argument("--engram", choices=ENGRAM_PLACEMENTS, default="sharded", help="Engram table placement")
    p.add_argument("--redundant-experts", type=int, default=0, help="extra physical expert slots per layer")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=64, help="running sequences per rank")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--cache-dtype", default="bfloat16")
    p.add_argument("--expert-format", choices=("auto", "fp8", "fp4"), default="auto",
                   help="the routed experts on the GPU: FP8 stacks (2x the release) or the release's MXFP4; auto: "
                        "as the engine resolves EngineArgs.expert_format for these GPUs")
    p.add_argument("--reserve", default=f"{DEFAULT_RESERVE_BYTES >> 30}GiB",
                   help="per-GPU activation / workspace reserve (default %(default)s)")
    return p


def main(argv=None) -> int:
    from deepinfer.parallel.planner import plan_memory, release_config_dir
    from deepinfer.worker.loading import planned_expert_share, resolved_expert_format
    a = _parser().parse_args(argv)
    try:
        model_args = read_model_args(a.config or release_config_dir())
        experts = resolved_expert_format(a.expert_format, "cuda", False, model_args,
                                         planned_expert_share(model_args, a.gpus, a.redundant_experts),
                                         parse_size(a.gpu_memory))
        print(f"routed experts held as {experts.upper()} (--expert-format {a.expert_format})")
        plan = plan_memory(model_args, num_gpus=a.gpus,
                           gpu_memory_bytes=parse_size(a.gpu_memory), num_redundant_experts=a.redundant_experts,
                           engram_placement=a.engram, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                           block_tokens=a.block_tokens, cache_dtype=a.cache_dtype,
                           reserve_bytes=parse_size(a.reserve), expert_format=experts)
    except ValueError as e:                  # ConfigError and bad numbers alike
        print(f"deepinfer-plan: error: {e}", file=sys.stderr)
        return 2
    print(plan.table())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
