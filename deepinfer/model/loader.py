"""Load a release-format V4.1 checkpoint: HF `config.json` + safetensors shards (release tensor names).

Dtypes: F8_E4M3 weights with an F8_E8M0 `.scale` per 32x32 block (read as raw bytes), I8-packed FP4
routed experts with an F8_E8M0 scale per 32 along K, BF16 / F32 elsewhere; or every linear in BF16
(no `quantization_config`). The headers of every shard are checked against the names, shapes and
dtypes the config implies BEFORE any data is read, so a bad checkpoint fails with one message naming
the tensor and nothing half-loaded is returned. Data is then read lazily, shard by shard (mmap).

Renaming rules (checkpoint name -> module attribute) live in one place: `_target`.

Weight formats on the device (`load_model(weight_format=...)`):
    "dense"  FP8 linears dequantized to the compute dtype (fp32 on CPU, bf16 on CUDA); FP4 experts
             dequantized too, or kept packed and dequantized per use (pack_experts, CUDA default).
             The CPU default.
    "fp8"    the release format: FP8 linears keep e4m3 + E8M0 (Linear.fp8, run by ops.fp8_linear);
             FP4 experts become FP8 once at load (exact) in per-layer stacks (moe.ExpertStacks) for
             the grouped and masked GEMMs. The CUDA default. Same logits as "dense" on a CPU
             (tests/model/test_weight_formats.py).
    Either way wo_a stays dense: attention runs it as a block-diagonal bf16 einsum on `.weight`
    (no activation rounding, as convert.py dequantizes it), so there is nothing for an FP8 GEMM.
    dense_bf16 (with "fp8"): the dense FP8 linears (attention, shared experts, indexer, DSpark; not the
    routed experts) dequantized once at load into the compute dtype, exactly (e4m3 times a power of
    two is a bf16 value): act_quant + cuBLAS in every step, decode graphs included, for one more byte
    per dense weight element on the device (EngineArgs.dense_weights="bf16").
"""

from __future__ import annotations

import json
import logging
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import ops
from .args import ModelArgs

ST_DTYPES = {
    "F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E8M0": (torch.uint8, 1), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
}

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config (missing shard / tensor, wrong shape or dtype)."""


@dataclass
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path.name}: not a safetensors file (truncated header)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError:
            raise CheckpointError(f"{path.name}: not a safetensors file (bad header)") from None
    base, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        out[name] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
    return out


def checkpoint_index(ckpt: Path) -> dict[str, TensorInfo]:
    """name -> TensorInfo over every shard; a missing shard fails naming it and a tensor it holds."""
    idx_path = ckpt / "model.safetensors.index.json"
    if idx_path.is_file():
        weight_map = json.loads(idx_path.read_text())["weight_map"]
        files = {}
        for name, fn in weight_map.items():
            files.setdefault(fn, name)
        infos = {}
        for fn, example in files.items():
            if not (ckpt / fn).is_file():
                raise CheckpointError(f"shard {fn} is missing (it holds tensor {example!r})")
            infos.update(read_header(ckpt / fn))
        for name, fn in weight_map.items():
            if name not in infos:
                raise CheckpointError(f"tensor {name!r}: listed in the index for {fn} but not in that shard")
        return infos
    single = ckpt / "model.safetensors"
    if single.is_file():
        return read_header(single)
    raise CheckpointError(f"{ckpt}: no model.safetensors.index.json or model.safetensors")


# ---- what the config implies ------------------------------------------------------------------
def expected_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (kind, logical shape). kinds: fp8 (FP8 linear, or BF16 in bf16 checkpoints),
    fp4 (routed expert), bf16, f32, norm (BF16 or F32), table (Engram FP8 rows)."""
    E: dict[str, tuple[str, tuple[int, ...]]] = {}
    d, H, hd, qr = args.dim, args.n_heads, args.head_dim, args.q_lora_rank
    inter, hc = args.moe_inter_dim, args.hc_mult
    mix = (2 + hc) * hc

    def block(p: str, L: int):
        E[p + "attn_norm.weight"] = ("norm", (d,))
        E[p + "ffn_norm.weight"] = ("norm", (d,))
        for sub in ("attn", "ffn"):
            E[f"{p}hc_{sub}_fn"] = ("f32", (mix, hc * d))
            E[f"{p}hc_{sub}_base"] = ("f32", (mix,))
            E[f"{p}hc_{sub}_scale"] = ("f32", (3,))
        a = p + "attn."
        E[a + "attn_sink"] = ("f32", (H,))
        E[a + "wq_a.weight"] = ("fp8", (qr, d))
        E[a + "q_norm.weight"] = ("norm", (qr,))
        E[a + "wq_b.weight"] = ("fp8", (H * hd, qr))
        E[a + "wkv.weight"] = ("fp8", (hd, d))
        E[a + "kv_norm.weight"] = ("norm", (hd,))
        E[a + "wo_a.weight"] = ("fp8", (args.o_groups * args.o_lora_rank, H * hd // args.o_groups))
        E[a + "wo_b.weight"] = ("fp8", (d, args.o_groups * args.o_lora_rank))
        backbone = L < args.n_layers
        if backbone and L in args.kv_source_layers:
            E[a + "compressor.wkv.weight"] = ("bf16", (hd, d))
            if args.compress_ratios[L] > 1:
                E[a + "compressor.wgate.weight"] = ("bf16", (hd, d))
            E[a + "compressor.norm.weight"] = ("norm", (hd,))
        if backbone and L in args.index_source_layers:
            ih, ihd = args.index_n_heads, args.index_head_dim
            E[a + "indexer.wq_b.weight"] = ("fp8", (ih * ihd, qr))
            E[a + "indexer.weights_proj.weight"] = ("bf16", (ih, d))
            if L in args.kv_source_layers:
                E[a + "indexer.wk.weight"] = ("bf16", (ihd, hd))
                E[a + "indexer.k_norm.weight"] = ("norm", (ihd,))
        f = p + "ffn."
        n_exp, _ = args.get_moe_config(L)
        E[f + "gate.weight"] = ("bf16", (n_exp, d))
        E[f + "gate.bias"] = ("f32", (n_exp,))
        for e in range(n_exp):
            E[f"{f}experts.{e}.w1.weight"] = ("fp4", (inter, d))
            E[f"{f}experts.{e}.w3.weight"] = ("fp4", (inter, d))
            E[f"{f}experts.{e}.w2.weight"] = ("fp4", (d, inter))
        for w, shp in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            E[f"{f}shared_experts.{w}.weight"] = ("fp8", shp)
        if backbone and L in args.engram_layer_ids:
            li = args.engram_layer_ids.index(L)
            en = p + "engram."
            E[en + "embed.weight"] = ("table", (args.engram_num_embeddings[li], args.engram_head_dim))
            E[en + "wkv.weight"] = ("fp8", (d * (hc + 1), args.n_hash_cols * args.engram_head_dim))
            E[en + "q_weight"] = ("norm", (hc, d))
            E[en + "k_weight"] = ("norm", (hc, d))

    E["embed.weight"] = ("bf16", (args.vocab_size, d))
    if args.vision is not None:
        E.update(vision_tensors(args))
    E["head.weight"] = ("bf16", (args.vocab_size, d))
    E["norm.weight"] = ("norm", (d,))
    for L in range(args.n_layers):
        block(f"layers.{L}.", L)
    if args.dspark_block_size:
        for j in range(args.n_mtp_layers):
            p = f"mtp.{j}."
            block(p, args.n_layers + j)
            if j == 0:
                E[p + "main_proj.weight"] = ("fp8", (d, d * len(args.dspark_target_layer_ids)))
                E[p + "main_norm.weight"] = ("norm", (d,))
            if j == args.n_mtp_layers - 1:
                E[p + "norm.weight"] = ("norm", (d,))
                E[p + "markov_head.embed.weight"] = ("bf16", (args.vocab_size, args.dspark_markov_rank))
                E[p + "markov_head.head.weight"] = ("bf16", (args.vocab_size, args.dspark_markov_rank))
                E[p + "confidence_head.proj.weight"] = ("bf16", (1, d + args.dspark_markov_rank))
    return E


def vision_tensors(args: ModelArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The vision tower's release tensors (all BF16): vision.*, aligner.*, image_{start,end,newline}."""
    v, d = args.vision, args.dim
    E = {"vision.patch_embed.proj.weight": ("bf16", (v.dim, v.patch_dim)),
         "vision.patch_embed.proj.bias": ("bf16", (v.dim,)), "vision.norm.weight": ("norm", (v.dim,))}
    for i in range(v.n_layers):
        b = f"vision.blocks.{i}."
        E.update({b + "norm1.weight": ("norm", (v.dim,)), b + "norm2.weight": ("norm", (v.dim,)),
                  b + "attn.wqkv.weight": ("bf16", (3 * v.dim, v.dim)), b + "attn.wqkv.bias": ("bf16", (3 * v.dim,)),
                  b + "attn.wo.weight": ("bf16", (v.dim, v.dim)), b + "attn.wo.bias": ("bf16", (v.dim,)),
                  b + "mlp.w1.weight": ("bf16", (2 * v.inter_dim, v.dim)),
                  b + "mlp.w2.weight": ("bf16", (v.dim, v.inter_dim))})
    cell = v.dim * v.downsample_ratio ** 2
    E.update({"aligner.w1.weight": ("bf16", (d, cell)), "aligner.w1.bias": ("bf16", (d,)),
              "aligner.w2.weight": ("bf16", (d, d)), "aligner.w2.bias": ("bf16", (d,))})
    for name in ("image_start", "image_end", "image_newline"):
        E[name] = ("bf16", (d,))
    return E


def _stored(kind: str, shape: tuple[int, ...], args: ModelArgs) -> list[tuple[str, str, tuple]]:
    """(suffix, allowed dtype(s), stored shape) of the tensors one logical weight is stored as."""
    n, k = shape if len(shape) == 2 else (shape[0], 1)
    blk = lambda a: (a + 31) // 32  # noqa: E731
    if kind == "fp8":
        if args.dtype == "fp8":
            return [("", "F8_E4M3", shape), (".scale", "F8_E8M0", (blk(n), blk(k)))]
        return [("", "BF16", shape)]
    if kind == "fp4":
        if args.expert_dtype == "fp4":
            return [("", "I8", (n, k // 2)), (".scale", "F8_E8M0", (n, k // 32))]
        return [("", "BF16", shape)]
    if kind == "table":
        return [("", "F8_E4M3", shape), (".scale", "F8_E8M0", (n, k // 32))]
    if kind == "bf16":
        return [("", "BF16|F32", shape)]
    if kind == "f32":
        return [("", "F32", shape)]
    return [("", "BF16|F32", shape)]     # norm-like


def _scale_name(name: str, suffix: str) -> str:
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return base + suffix


def validate(args: ModelArgs, infos: dict[str, TensorInfo]) -> dict[str, tuple[str, tuple]]:
    expected = expected_tensors(args)
    for name, (kind, shape) in expected.items():
        for suffix, dtypes, shp in _stored(kind, shape, args):
            tname = name if not suffix else _scale_name(name, suffix)
            info = infos.get(tname)
            if info is None:
                raise CheckpointError(f"tensor {tname!r} is missing from the checkpoint")
            if info.dtype not in dtypes.split("|"):
                raise CheckpointError(f"tensor {tname!r} has dtype {info.dtype}, expected {dtypes.replace('|', ' or ')}")
            if tuple(info.shape) != tuple(shp):
                raise CheckpointError(f"tensor {tname!r} has shape {list(info.shape)}, expected {list(shp)}")
    return expected


def dummy_index(args: ModelArgs, expected: dict) -> dict[str, TensorInfo]:
    """name -> TensorInfo (no file) of every stored tensor the config implies (load_format="dummy")."""
    infos = {}
    for name, (kind, shape) in expected.items():
        for suffix, dtypes, shp in _stored(kind, shape, args):
            tname = name if not suffix else _scale_name(name, suffix)
            infos[tname] = TensorInfo(None, dtypes.split("|")[0], tuple(shp), 0, 0)
    return infos


def _tokenizer_json(ckpt: Path, given, load_format: str) -> Path:
    """The checkpoint's tokenizer.json (Engram hashing needs it); a dummy load without one takes the
    V4.1 tokenizer the checkpoint generator writes."""
    tj = Path(given) if given else ckpt / "tokenizer.json"
    if tj.is_file():
        return tj
    if load_format == "dummy":
        import tempfile

        from deepinfer.checkpoint.tokenizer import write_tokenizer
        return write_tokenizer(Path(tempfile.mkdtemp(prefix="deepinfer-tok-")) / "tokenizer.json")
    raise CheckpointError(f"{tj}: missing (Engram hashing needs the checkpoint's tokenizer.json)")


class _open_source:
    """Context manager: an mmap of one shard, or the dummy reader (path None)."""

    def __init__(self, path, expected, device) -> None:
        self.path, self.expected, self.device = path, expected, device
        self._f = self._mm = None

    def __enter__(self):
        if self.path is None:
            from .dummy_weights import DummyReader
            return DummyReader(self.expected, self.device)
        self._f = open(self.path, "rb")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def __exit__(self, *exc) -> None:
        if self._mm is not None:
            self._mm.close()
            self._f.close()


def _local_targets(model, name: str) -> list[str]:
    """Module paths a checkpoint tensor loads into: itself, or for an expert-parallel layer's routed
    expert the local slots holding that logical expert (none: this rank skips it unread)."""
    m = _EXPERT_ID.fullmatch(name)
    if m is None:
        return [name]
    prefix, e, rest = m.group(1), int(m.group(2)), m.group(3)
    moe = _target(model, prefix + ".gate")[0]
    if moe.ep is None:
        return [name]
    return [f"{prefix}.experts.{i}.{rest}" for i, le in enumerate(moe.ep.local_logical()) if le == e]


def _read(info: TensorInfo, mm, name: str = "") -> torch.Tensor:
    if not isinstance(mm, mmap.mmap):                       # load_format="dummy"
        return mm.read(name, info.dtype, info.shape)
    tdtype, size = ST_DTYPES[info.dtype]
    buf = np.frombuffer(mm, dtype=np.uint8, count=info.end - info.start, offset=info.start)
    t = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf.size else torch.empty(0, dtype=torch.uint8)
    return t.view(tdtype).reshape(info.shape)


def _read_rows(info: TensorInfo, mm, name: str, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of a 2-D tensor, reading only their bytes."""
    if (lo, hi) == (0, info.shape[0]):
        return _read(info, mm, name)
    if not isinstance(mm, mmap.mmap):
        return mm.read(name, info.dtype, (hi - lo, *info.shape[1:]))
    row_bytes = (info.end - info.start) // info.shape[0]
    part = TensorInfo(info.file, info.dtype, (hi - lo, *info.shape[1:]), info.start + lo * row_bytes,
                      info.start + hi * row_bytes)
    return _read(part, mm, name)


# checkpoint prefix -> module path: the vision tower's release names sit at the top level
_RENAMES = (("vision.", "vision_tower.vit."), ("aligner.", "vision_tower.aligner."),
            ("image_", "vision_tower.image_"))


def _target(model, name: str):
    """Checkpoint name -> (module, attribute). The only renaming rules."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    path = name.split(".")
    attr = path[-1]
    mod = model
    for p in path[:-1]:
        mod = getattr(mod, p) if not p.isdigit() else mod[int(p)]
    return mod, attr


def load_model(ckpt_dir: str | Path, device: str | torch.device = "cpu", progress: bool = True,
               tokenizer_json: str | Path | None = None, pack_experts: bool | None = None,
               weight_format: str | None = None, moe_masked: bool | None = None, fuse_linears: bool | None = None,
               expert_row_scales: bool | None = None, wo_a_fp8: bool | None = None, parallel=None,
               load_format: str = "safetensors", dense_bf16: bool = False, expert_format: str = "fp8",
               dense_fp8_copy: bool | frozenset = False, engram_placement: str = "device", **arg_overrides):
    """Build the Transformer from a checkpoint folder; raise CheckpointError/ConfigError on bad input.

    weight_format: "dense" or "fp8" (the module docstring); default "fp8" on CUDA, "dense" elsewhere.
    pack_experts ("dense" only): keep FP4 routed experts packed on the device and dequantize them per
    use (default: on for CUDA, where a full-width layer's experts would take 27 GB dequantized).
    moe_masked ("fp8" only): MoE.masked, the sync-free masked expert form; None = on CUDA for
    decode-sized steps, True = every step on any device (CPU tests), False = never.
    fuse_linears ("fp8" only): Linears that read the same input run as one GEMM (model/fused_linears.py);
    None = on CUDA (a CPU keeps them apart: its fp32 matmuls are what the fixtures' bits were made with).
    expert_row_scales ("fp8" only): re-express the FP8 expert stacks with one scale per row where that is
    exact (ExpertStacks.to_row_scales: the same values, a scale-free K loop in the masked GEMMs);
    None = on CUDA. wo_a_fp8 ("fp8" only): the block-diagonal wo_a stays FP8 (Linear.fp8_blocks, run by
    ops.grouped_w8a16) instead of a dequantized bf16 copy; None = on CUDA. With dense_bf16 and a dense_fp8_copy
    that names wo_a's kind (or True), wo_a keeps both: the bf16 copy and, for decode-sized calls
    (ops.grouped_takes_fp8), its FP8 blocks.
    parallel: a deepinfer.parallel.ParallelState with an expert placement: this rank builds and reads
    only its own routed experts (local slots; a redundant replica is read once per slot holding it).
    load_format: "safetensors" (the release shards) or "dummy" (random weights of the config, made
    on the device: model/dummy_weights.py; the folder then needs only config.json).
    dense_bf16 ("fp8" only): the dense FP8 linears as exact compute-dtype weights (the module docstring).
    dense_fp8_copy (with dense_bf16): each such Linear also keeps the release's FP8 bytes (Linear.fp8_decode);
    a frozenset of tensor kinds ("layers.N.attn.wq_b.weight", worker/loading.py dense_fp8_copies): only those
    for decode-sized calls on the CUDA FP8 x FP8 decode GEMM; one more byte per dense element.
    engram_placement: "device" (the tables on the device, or split over the ranks where `parallel` says so) or
    "host" (in host memory, read by the GPU from there: model/host_tables.py; one copy per node for rank workers).
    expert_format ("fp8" only): the routed experts' stacks (moe.ExpertStacks): "fp8" (e4m3, twice the
    release's bytes) or "fp4" (the release's MXFP4 bytes, half the memory, W4A16 kernels); a layer whose
    block scales the W4A16 decode cannot take (fp4_layout.fp4_scales_ok) gets FP8 stacks, logged once."""
    from .engram import NgramHasher, compressed_token_map
    from .layers import compute_dtype
    from .moe import MoE
    from .transformer import Transformer

    ckpt = Path(ckpt_dir)
    cuda = torch.device(device).type == "cuda"
    weight_format = weight_format or ("fp8" if cuda else "dense")
    if weight_format not in ("dense", "fp8"):
        raise ValueError(f"weight_format must be 'dense' or 'fp8', got {weight_format!r}")
    if expert_format not in ("fp8", "fp4"):
        raise ValueError(f"expert_format must be 'fp8' or 'fp4', got {expert_format!r}")
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    args = ModelArgs.from_checkpoint(ckpt, **arg_overrides)
    if load_format == "dummy":
        expected = expected_tensors(args)
        infos = dummy_index(args, expected)
    else:
        infos = checkpoint_index(ckpt)
        expected = validate(args, infos)
    hasher = None
    if args.engram_layer_ids:
        hasher = NgramHasher(args, *compressed_token_map(_tokenizer_json(ckpt, tokenizer_json, load_format)))
    with torch.device("meta"):
        model = Transformer(args, hasher=None, parallel=parallel)
    model.hasher = hasher.to(device) if hasher is not None else None
    if engram_placement not in ("device", "host"):
        raise ValueError(f"engram_placement must be 'device' or 'host', got {engram_placement!r}")
    if engram_placement == "host":
        from .host_tables import install_host_tables
        install_host_tables(model, parallel)
    if dense_bf16 and weight_format != "fp8":
        raise ValueError("dense_bf16 applies to weight_format='fp8' (the 'dense' format is dense throughout)")
    if dense_fp8_copy and not dense_bf16:
        raise ValueError("dense_fp8_copy keeps an FP8 copy beside dense_bf16's weights: it needs dense_bf16")
    fmt = _Format(device, compute_dtype(device), weight_format,
                  cuda if pack_experts is None else pack_experts,
                  weight_format == "fp8" and not dense_bf16 and (cuda if wo_a_fp8 is None else wo_a_fp8),
                  dense_bf16, weight_format == "fp8" and expert_format == "fp4", dense_fp8_copy,
                  wo_a_copy=bool(dense_bf16 and dense_fp8_copy) and (cuda if wo_a_fp8 is None else wo_a_fp8))
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(infos[name].file, []).append(name)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(expected), desc=f"loading {ckpt.name}", unit="tensor", leave=False)
    for path, names in by_file.items():
        with _open_source(path, expected, device) as mm:
            for name in names:
                for target in _local_targets(model, name):
                    _load_one(model, name, expected[name][0], infos, mm, fmt, target)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    _fp4_fallback(model)
    _materialize_rest(model, device)
    for mod in model.modules():
        if isinstance(mod, MoE) and mod.ep is not None:
            mod.ep.to(device)
    _fill_optional(model, infos, device)
    for mod in model.modules():
        if isinstance(mod, MoE):
            mod.masked = moe_masked
    if weight_format == "fp8" and (cuda if fuse_linears is None else fuse_linears):
        fuse_input_linears(model)
    if weight_format == "fp8" and (cuda if expert_row_scales is None else expert_row_scales):
        stacks = [m.stacks for m in model.modules() if isinstance(m, MoE) and m.stacks is not None]
        done = sum(st.to_row_scales() for st in stacks)
        log.info("expert stacks with one scale per row: %d of %d layers (the rest keep per-32 scales)",
                 done, len(stacks))
    if weight_format == "fp8":                  # DEEPINFER_GEMM=deepgemm: 128-tile weights, once (else a no-op)
        from deepinfer.kernels.deepgemm import prepare_deepgemm
        prepare_deepgemm(model)
    return model.eval()


def _fp4_fallback(model) -> None:
    """FP4 expert stacks of layers with a block scale the W4A16 decode cannot take, as FP8 stacks (the same
    weights); said once."""
    from .moe import MoE
    moes = [m for m in model.modules() if isinstance(m, MoE) and getattr(m, "fp4_declined", False)]
    for m in moes:
        m.set_stacks(m.stacks.to_fp8())
    if moes:
        log.warning("expert_format='fp4': %d MoE layer(s) hold block scales outside 2^-125..2 (the W4A16 decode's "
                    "range): those keep FP8 stacks", len(moes))


def fuse_input_linears(model) -> int:
    """Every module's Linears that share an input, stacked into one GEMM; returns how many fused."""
    return sum(bool(m.fuse_input_linears()) for m in model.modules() if hasattr(m, "fuse_input_linears"))


@dataclass
class _Format:
    """How _load_one places a tensor (load_model's arguments, resolved)."""
    device: torch.device | str
    wdtype: torch.dtype            # dense linear weights: the compute dtype
    weight_format: str             # "dense" | "fp8"
    pack_experts: bool             # "dense": FP4 experts stay packed
    wo_a_fp8: bool = False         # "fp8": wo_a keeps its FP8 blocks (Linear.fp8_blocks)
    dense_bf16: bool = False       # "fp8": dense FP8 linears dequantized at load (experts stay FP8)
    expert_fp4: bool = False       # "fp8": the routed experts in FP4 stacks (expert_format="fp4")
    dense_fp8_copy: bool | frozenset = False   # dense_bf16: also keep the FP8 bytes (Linear.fp8_decode): all, or
                                               # of these tensor kinds ("layers.N.attn.wq_b.weight")
    wo_a_copy: bool = False        # dense_bf16: wo_a may keep its FP8 blocks beside the bf16 weight where
                                   # dense_fp8_copy names its kind (decode-sized calls)

    def keeps_fp8_copy(self, name: str) -> bool:
        copy = self.dense_fp8_copy
        return copy is True or (bool(copy) and tensor_kind(name) in copy)


def _materialize_rest(model, device) -> None:
    """Buffers the checkpoint did not fill (gate.bias_vl, which _fill_optional sets next) get device
    memory, as `to_empty` would give them. The model stays on `meta` while loading so only loaded
    tensors take memory: `to_empty` first would allocate every declared buffer, each linear at its
    full fp32 size, before the checkpoint replaces it (a full-width layer's 384 experts: 54 GB)."""
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                setattr(mod, name, torch.empty_like(buf, device=device))
        for name, par in list(mod.named_parameters(recurse=False)):
            if par.is_meta:
                setattr(mod, name, torch.nn.Parameter(torch.empty_like(par, device=device), par.requires_grad))


def _fill_optional(model, infos, device) -> None:
    """gate.bias_vl (image-span routing bias) is read when present, else equals gate.bias."""
    from .moe import Gate
    for mname, mod in model.named_modules():
        if isinstance(mod, Gate):
            name = mname + ".bias_vl"
            if name in infos and infos[name].dtype == "F32" and tuple(infos[name].shape) == tuple(mod.bias.shape):
                with open(infos[name].file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    mod.bias_vl = _read(infos[name], mm).to(device)
            else:
                mod.bias_vl = mod.bias.clone()


_declined: set[str] = set()


def _decline_once(what: str, why: str) -> None:
    """One log line per kind of declined fast form (not one per layer)."""
    if what not in _declined:
        _declined.add(what)
        log.warning("%s: %s; keeping the dense bf16 form (same values, the einsum path)", what, why)


def wo_a_blocks(w: torch.Tensor, scale: torch.Tensor, groups: int, name: str = "wo_a"):
    """wo_a [G * R, K] e4m3 + E8M0 per 32x32 tile [ceil(G*R/32), ceil(K/32)] -> its G diagonal blocks
    (e4m3 [G, R, K], E8M0 [G, R/32, K/32]), or with R % 32 != 0 (a 32-row tile spans two groups)
    one scale per row (E8M0 [G, R, K/32], the same values: ops.grouped_w8a16 takes either). None
    where the grouped FP8 GEMM cannot take the weight (K % 32 != 0): the caller keeps it dense."""
    rows, k = w.shape
    if rows % groups or k % 32:
        _decline_once("wo_a FP8 blocks", f"{name} has shape {list(w.shape)}: K = {k} is not a multiple of 32 "
                      f"or {rows} rows do not split into {groups} groups")
        return None
    r = rows // groups
    if r % 32:
        log.info("wo_a: %d rows per group (not a multiple of 32): one E8M0 scale per row", r)
        scale = scale.repeat_interleave(32, 0)[:rows]
    return w.unflatten(0, (groups, r)), scale.contiguous().unflatten(0, (groups, -1))


_EXPERT = re.compile(r"(.+)\.experts\.\d+\.w[123]\.weight")
_EXPERT_ID = re.compile(r"(.+)\.experts\.(\d+)\.(w[123]\.weight)")


def tensor_kind(name: str) -> str:
    """A tensor's name with its layer / block indices as N ("layers.N.attn.wq_b.weight"): one kind for all layers."""
    return re.sub(r"\.\d+\.", ".N.", name)


def _load_one(model, name, kind, infos, mm, fmt: _Format, target: str | None = None):
    """Read checkpoint tensor `name` (and its scale) into the module at `target` (default: name)."""
    info = infos[name]
    sname = _scale_name(name, ".scale") if name.endswith(".weight") else None
    scale_info = infos.get(sname) if sname else None
    mod, attr = _target(model, target or name)
    device = fmt.device
    if kind == "table" and getattr(mod, "host", False):       # host_tables.HostEngramTable: rows into host memory
        mod.fill(lambda lo, hi: _read_rows(info, mm, name, lo, hi),
                 lambda lo, hi: _read_rows(scale_info, mm, sname, lo, hi), device)
        return
    if kind == "table":                         # only the rows this module holds (a sharded table's slice)
        lo, hi = mod.row_range
        mod.weight = _read_rows(info, mm, name, lo, hi).to(device)
        mod.scale = _read_rows(scale_info, mm, sname, lo, hi).view(torch.uint8).to(device)
        return
    t = _read(info, mm, name)
    quantized = False
    # wo_a is block-diagonal and run as a bf16 einsum (convert.py dequantizes it): no act rounding
    wo_a = name.endswith("attn.wo_a.weight")
    if kind == "fp8" and info.dtype == "F8_E4M3":
        scale = _read(scale_info, mm, sname).view(torch.uint8)
        if fmt.weight_format == "fp8" and not wo_a and not fmt.dense_bf16:
            mod.fp8 = (t.to(device), scale.to(device))
            mod.weight = torch.empty(0, device=device)
            mod.quantized = True
            return
        copy = fmt.wo_a_copy and fmt.keeps_fp8_copy(name)          # beside the bf16 copy, where the budget lets it
        blocks = wo_a_blocks(t, scale, model.args.o_groups, name) if wo_a and (fmt.wo_a_fp8 or copy) else None
        if blocks is not None:
            mod.fp8_blocks = tuple(b.to(device) for b in blocks)
            if not copy:
                mod.weight = torch.empty(0, device=device)
                return
        if fmt.dense_bf16:                      # on the device: a CPU fp32 pass over every dense weight is slow
            t, scale = t.to(device), scale.to(device)
            if fmt.keeps_fp8_copy(name) and not wo_a:   # (wo_a: a block-diagonal einsum, never a Linear call)
                mod.fp8_decode = (t, scale)
        t = ops.dequant_fp8(t, scale)
        quantized = True
    elif kind == "fp4" and info.dtype == "I8":
        scale = _read(scale_info, mm, sname).view(torch.uint8)
        if fmt.weight_format == "fp8":
            moe = _target(model, _EXPERT.fullmatch(target or name).group(1) + ".stacks")[0]
            if moe.stacks is None:                  # the layer's first expert tensor: allocate its stacks
                (moe.init_fp4_stacks if fmt.expert_fp4 else moe.init_fp8_stacks)(device)
            if fmt.expert_fp4:                      # the release bytes, permuted for the W4A16 kernels
                from deepinfer.kernels.fp4_layout import fp4_kernel_weight, fp4_scales_ok
                t, scale = t.to(device), scale.to(device)
                moe.fp4_declined = getattr(moe, "fp4_declined", False) or not fp4_scales_ok(scale)
                pk, sk = fp4_kernel_weight(t, scale)
                mod.packed[0].copy_(pk)             # views into the layer's stacks
                mod.packed[1].copy_(sk)
                return
            w8, s8 = ops.fp4_to_fp8_weight(t.to(device), scale.to(device))
            mod.fp8[0].copy_(w8)                    # views into the layer's stacks
            mod.fp8[1].copy_(s8)
            return
        if fmt.pack_experts:
            mod.packed = (t.to(device), scale.to(device))
            mod.weight = torch.empty(0, device=device)
            mod.quantized = True
            return
        t = ops.dequant_fp4(t, scale)
        quantized = True
    if wo_a:
        quantized = False
    cur = getattr(mod, attr)
    if kind in ("fp8", "fp4", "bf16") and cur.dtype != torch.bfloat16:
        target_dtype = fmt.wdtype   # linear weights: exact values in the compute dtype
    else:
        target_dtype = cur.dtype
    setattr(mod, attr, t.to(device=device, dtype=target_dtype))
    if hasattr(mod, "quantized"):
        mod.quantized = quantized
