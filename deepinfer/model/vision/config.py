"""VisionArgs: the vision tower's shape and the image plan's limits, from the HF `vision_config`.

Release values (MODEL.md section 2.1, `vision_config`): 32 layers, hidden 1024, 16 heads, inter 2816,
patch 14, rope theta 10000, downsample 3 (3x3 unfold), at most 1024 LLM tokens per image, images
below 544^2 pixels scaled up to that area, max_wh_ratio null. Field names follow the reference's
`vision_*` ModelArgs keys without the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionArgs:
    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_n_token: int = 1024              # LLM tokens of one image span, delimiters included
    min_pixels: int = 544 * 544
    max_wh_ratio: int | None = None
    image_token_id: int = 129264

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Inverse frequencies per axis: a head's 64 dims are [h phases | w phases] of 16 each, rotated half."""
        return self.head_dim // 2

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size ** 2

    @classmethod
    def from_hf(cls, vc: dict | None, image_token_id: int = 129264) -> "VisionArgs | None":
        """None when the config has no vision tower (text-only checkpoints)."""
        if not vc or not vc.get("num_hidden_layers"):
            return None
        from deepinfer.model.args import ConfigError
        if vc.get("model_type", "deepseek_v41_vision") != "deepseek_v41_vision":
            raise ConfigError(f"config.json field 'vision_config.model_type' is {vc.get('model_type')!r}: "
                              "expected 'deepseek_v41_vision'")
        args = cls(
            n_layers=vc["num_hidden_layers"], dim=vc.get("hidden_size", 1024),
            n_heads=vc.get("num_attention_heads", 16), inter_dim=vc.get("intermediate_size", 2816),
            patch_size=vc.get("patch_size", 14), rope_theta=float(vc.get("rope_theta", 10000.0)),
            downsample_ratio=vc.get("downsample_ratio", 3), max_n_token=vc.get("max_image_tokens", 1024),
            min_pixels=vc.get("min_pixels", 544 * 544), max_wh_ratio=vc.get("max_wh_ratio"),
            image_token_id=image_token_id)
        if args.dim % args.n_heads or args.head_dim % 4:
            raise ConfigError("config.json fields 'vision_config.hidden_size / num_attention_heads' must give a "
                              "head_dim divisible by 4 (2D RoPE: two axes, rotate-half)")
        if args.max_n_token < 5:
            raise ConfigError("config.json field 'vision_config.max_image_tokens' must be at least 5 "
                              "(the smallest span: start, one image token, newline, end)")
        return args
