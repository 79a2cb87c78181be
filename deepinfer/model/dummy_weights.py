"""load_format="dummy" (vLLM's flag): random weights of any config, made on the target device in the
release format, with no checkpoint on disk. Whole-model benchmarks at the real size then need
only the config (a 475 GiB file would not fit the benchmark machines' disks).

The loader asks for each stored tensor (name, release dtype, stored shape) as it would read it
from a shard; `DummyReader.read` draws it from a per-name seed with magnitudes that keep the
activations in range (the generator's scales: deepinfer/checkpoint/generator.py), so the kernels
see realistic FP8 / FP4 codes and scales. Not a model: its outputs mean nothing.
"""

from __future__ import annotations

import math
import zlib

import torch

_NORM_SUFFIXES = ("norm.weight", "q_weight", "k_weight")
_FP4_MEAN_SQUARE = 11.3125      # mean square of the 16 e2m1 codes drawn uniformly


class DummyReader:
    def __init__(self, expected: dict, device, seed: int = 0) -> None:
        self.expected = expected        # name -> (kind, logical shape): loader.expected_tensors
        self.device = torch.device(device)
        self.seed = seed

    def read(self, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
        if dtype == "F8_E8M0":
            return self._scale(name, shape)
        if dtype == "I8":               # packed FP4 codes: every byte is two finite e2m1 values
            return torch.randint(-128, 128, shape, dtype=torch.int8, device=self.device, generator=g)
        x = torch.randn(shape, device=self.device, generator=g)
        if dtype == "F8_E4M3":
            return x.clamp(-448, 448).to(torch.float8_e4m3fn)
        return self._float(name, x).to(torch.bfloat16 if dtype == "BF16" else torch.float32)

    def _scale(self, name: str, shape) -> torch.Tensor:
        """E8M0 bytes giving the weight a std of about fan_in^-0.5 (table rows: 1)."""
        parent = name[: -len(".scale")] + ".weight"
        kind, logical = self.expected.get(parent, ("fp8", (1, 1)))
        fan_in = logical[-1]
        if kind == "table":
            e = 0
        elif kind == "fp4":
            e = round(math.log2(fan_in ** -0.5 / math.sqrt(_FP4_MEAN_SQUARE)))
        else:
            e = round(math.log2(fan_in ** -0.5))
        return torch.full(shape, 127 + e, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _float(name: str, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.checkpoint.generator import INIT
        if name.endswith(_NORM_SUFFIXES):
            return 1.0 + 0.1 * x
        if name.endswith("_scale") and "hc_" in name:
            return 1.0 + 0.25 * x.clamp(-2, 2)
        if name.endswith("_base") and "hc_" in name:    # [mix]: pre | post | comb, as the generator biases it
            hc = int(round(math.sqrt(1 + x.numel()) - 1))     # mix = (2 + hc) * hc
            base = 0.5 * x
            base[hc:2 * hc] += INIT["post_base"]
            base[2 * hc:] += INIT["comb_diag"] * torch.eye(hc, device=x.device).flatten()
            return base
        if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl", "embed.weight")) and x.dim() <= 2 \
                and not name.endswith("engram.embed.weight"):
            return x
        return x * x.shape[-1] ** -0.5
