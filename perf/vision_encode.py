"""The vision tower on the GPU: how fast images encode, and what encoding does to decode steps.

  1. encode: VisionTower.encode (ViT + aligner + span assembly, what the runner calls once per step
     for every image admitted) of the release-width tower (32 layers, 1024 wide, aligner to 5120) on
     1 and 16 images at once, for a typical photo (1024x701 px: 3774 patches, span 444) and the
     largest square (1302x1302: 8649 patches, span 994): ms per image, images/s, and the 16-image
     pass against 16 single-image passes (what batching across requests buys).
  2. decode slowdown: the full-width-ep8 backbone's decode step (CUDA graph replays, batch --batch at
     --ctx) driven as the engine drives it (one host thread, one step of lookahead), per step: alone,
     then with the engine's own ImageEncoder (worker/image_embeds.py) encoding one-image requests
     back to back on its CUDA stream from that same thread (ratio = the decode-step slowdown while
     images are being encoded), the same with the steps on a high-priority stream, and inline (the
     encode on the step stream, as the rank workers of a multi-GPU engine do); with --sm-shares, the
     encoder on each share of the SMs (EngineArgs.vision_sm_share: a green context's stream): the step's
     slowdown against the images/s the encoder still makes, plotted (vision_sm_shares_<gpu>.png).

    python perf/vision_encode.py --quick                (< 2 min on an H200; vision_encode.json in $OUT)
    python perf/vision_encode.py --quick --sm-shares 0.125 0.25 0.5
    python perf/vision_encode.py                        (both image sizes, more repeats)
    python perf/vision_encode.py --device cpu --tiny    (a CPU smoke run of the code paths, tiny tower)

Weights are random (dummy): timing does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIZES = {"photo 1024x701": (1024, 701), "max 1302x1302": (1302, 1302)}


def build_tower(v, dim: int, device: str):
    from deepinfer.model.vision import VisionTower
    tower = VisionTower(v, dim)
    g = torch.Generator().manual_seed(0)
    wdtype = torch.bfloat16 if device == "cuda" else torch.float32
    for mod in tower.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is None:
                continue
            if buf.dim() == 2:
                val = (torch.randn(buf.shape, generator=g) * buf.shape[1] ** -0.5).to(wdtype)
            elif name == "weight":
                val = torch.ones(buf.shape)
            else:
                val = 0.02 * torch.randn(buf.shape, generator=g)
            setattr(mod, name, val.to(device))
    return tower.eval()


def make_image(w: int, h: int, v, seed: int):
    import io

    import numpy as np
    from PIL import Image

    from deepinfer.model.vision import load_image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return load_image(buf.getvalue(), v)


def timed(fn, device: str, iters: int) -> float:
    """Median seconds of fn() on the current stream (CUDA events on it, never a device-wide sync: a
    side stream's encoder keeps running while the step is timed)."""
    fn()
    ts = []
    for _ in range(iters):
        if device == "cuda":
            stream = torch.cuda.current_stream()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def tower_flops(v, n: int, cells: int, dim: int) -> float:
    """Multiply-adds x 2 of one image of n patches (cells aligner rows): the GEMMs and attention."""
    per_layer = 2 * n * v.dim * (3 * v.dim + v.dim + 2 * v.inter_dim + v.inter_dim) + 4 * n * n * v.dim
    return v.n_layers * per_layer + 2 * n * v.patch_dim * v.dim + 2 * cells * (9 * v.dim * dim + dim * dim)


def bench_encode(tower, v, device: str, iters: int, sizes: dict = SIZES) -> list[dict]:
    rows = []
    print(f"{'image':>16} {'batch':>5} {'ms/pass':>9} {'ms/image':>9} {'images/s':>9} {'vs 1-by-1':>9} {'patches':>8} "
          f"{'TFLOP/s':>8}", flush=True)
    for label, (w, h) in sizes.items():
        img = make_image(w, h, v, 0)
        one = timed(lambda: tower.encode([img]), device, iters)
        for n in (1, 16):
            imgs = [img] * n
            t = one if n == 1 else timed(lambda: tower.encode(imgs), device, max(2, iters // 4))
            tflops = n * tower_flops(v, img.patches.shape[0], img.plan.n_llm_h * img.plan.n_llm_w,
                                     tower.aligner.w2.weight.shape[0]) / t / 1e12
            row = dict(image=label, batch=n, ms_pass=t * 1e3, ms_per_image=t * 1e3 / n, images_per_s=n / t,
                       batched_over_serial=(n * one) / t, patches=img.patches.shape[0], span=img.span_len,
                       tflops=tflops)
            rows.append(row)
            print(f"{label:>16} {n:>5} {t * 1e3:>9.2f} {t * 1e3 / n:>9.2f} {n / t:>9.1f} {n * one / t:>9.2f} "
                  f"{img.patches.shape[0]:>8} {tflops:>8.1f}", flush=True)
    return rows


def load_backbone(preset: str, device: str):
    from deepinfer.checkpoint.generator import VISION, hf_config, text_config
    from deepinfer.model.loader import load_model
    d = tempfile.mkdtemp(prefix=f"vision-encode-{preset}-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_config(text_config(preset), VISION.get(preset)), f)
    return load_model(d, device, load_format="dummy", progress=False)


def bench_decode_slowdown(model, device: str, batch: int, ctx: int, steps: int, image, sm_shares=()) -> dict:
    """Decode steps of a running batch as the engine drives them (one host thread; each step's graph
    replayed, its event read back one step later: async scheduling), timed per step over `steps`
    steps: alone; with the engine's own ImageEncoder (worker/image_embeds.py) keeping the GPU busy
    with image encodes (a new one-image request submitted and flushed whenever the previous encode
    has finished, i.e. images arriving back to back); the same with the steps on a high-priority
    stream; and inline (the encode on the step stream, as a rank worker of a multi-GPU engine does)."""
    from bench_model_decode import decode_step

    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model.vision import expand_image_placeholders
    from deepinfer.worker.image_embeds import ImageEncoder
    block_tokens, max_len = 64, ctx + 64
    caches = ModelCaches.allocate(model.args, batch, batch * -(-max_len // block_tokens), block_tokens, device,
                                  scratch=True)
    tower, img_id = model.vision_tower, model.args.vision.image_token_id
    cuda = device == "cuda"

    def new_prompt():
        return expand_image_placeholders([0, img_id, 1], [image], img_id)

    with torch.inference_mode():
        step = decode_step(model, caches, batch, ctx, max_len, block_tokens, device=device)
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(), step()                                     # warm up eagerly before capture
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            run = g.replay
        else:
            run = step
        encoder = ImageEncoder(tower)
        encode = timed(lambda: tower.encode([image]), device, 3)

        def loop(mode: str, stream=None) -> tuple[float, int]:
            """-> (seconds per step, images whose encode finished during the loop)."""
            ctx_mgr = torch.cuda.stream(stream) if stream is not None else _null()
            done, pending, events = 0, None, []
            with ctx_mgr:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    if mode == "encoder" and (pending is None or pending.ready):
                        done += pending is not None
                        pending = new_prompt()
                        encoder.submit(pending)
                        encoder.flush()                            # what engine.step does before its step
                    elif mode == "inline":
                        tower.encode([image])
                        done += 1
                    run()
                    if cuda:
                        ev = torch.cuda.Event()
                        ev.record()
                        events.append(ev)
                        if len(events) > 1:
                            events.pop(0).synchronize()            # the previous step's tokens
                if cuda:
                    events[-1].synchronize()
                dt = (time.perf_counter() - t0) / steps
                if pending is not None and cuda:
                    pending.event.synchronize()
            return dt, done

        loop("alone")                                              # warm the loop itself
        alone, _ = loop("alone")
        beside, n_beside = loop("encoder")
        row = dict(batch=batch, ctx=ctx, steps=steps, step_ms=alone * 1e3, step_ms_while_encoding=beside * 1e3,
                   slowdown=beside / alone, images_encoded_meanwhile=n_beside,
                   images_per_s_meanwhile=n_beside / (beside * steps), encode_ms=encode * 1e3)
        if cuda:
            high = torch.cuda.Stream(priority=-1)                  # steps above the encoder's default priority
            high.wait_stream(torch.cuda.current_stream())
            alone_hp, _ = loop("alone", high)
            beside_hp, n_hp = loop("encoder", high)
            row.update(step_ms_high_priority=alone_hp * 1e3, step_ms_while_encoding_high_priority=beside_hp * 1e3,
                       slowdown_high_priority=beside_hp / alone_hp, images_encoded_meanwhile_high_priority=n_hp)
        inline, n_inline = loop("inline")
        row.update(inline_step_ms=inline * 1e3, inline_slowdown=inline / alone)
        row["sm_shares"] = []
        for share in sm_shares if cuda else ():
            encoder = ImageEncoder(tower, sm_share=share)       # what EngineArgs.vision_sm_share builds
            with torch.cuda.stream(encoder.stream):
                enc = timed(lambda: tower.encode([image]), device, 3)
            torch.cuda.synchronize()
            part, n_part = loop("encoder")
            row["sm_shares"].append(dict(share=share, num_sms=encoder.num_sms, step_ms_while_encoding=part * 1e3,
                                         slowdown=part / alone, images_per_s_meanwhile=n_part / (part * steps),
                                         encode_ms=enc * 1e3))
            print(f"  encoder on {share} of the SMs ({encoder.num_sms or 'all'} SMs): step {part * 1e3:.2f} ms "
                  f"(x{part / alone:.2f}), {n_part / (part * steps):.1f} images/s meanwhile; one encode alone "
                  f"{enc * 1e3:.1f} ms", flush=True)
    print(f"decode step B={batch} ctx={ctx} ({steps} steps): {alone * 1e3:.2f} ms alone, "
          f"{beside * 1e3:.2f} ms while the engine's ImageEncoder encodes back to back on its stream over every SM "
          f"(slowdown x{beside / alone:.2f}, {n_beside} images meanwhile, {row['images_per_s_meanwhile']:.1f}/s)",
          flush=True)
    if cuda:
        print(f"  steps on a high-priority stream: {alone_hp * 1e3:.2f} ms alone, {beside_hp * 1e3:.2f} ms beside "
              f"the encoder (x{beside_hp / alone_hp:.2f}, {n_hp} images meanwhile)", flush=True)
    print(f"  inline (an image encoded on the step stream before every step): {inline * 1e3:.2f} ms "
          f"(x{inline / alone:.2f}); one encode alone {encode * 1e3:.1f} ms", flush=True)
    return row


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="full-width-ep8", help="backbone of the decode-slowdown part")
    p.add_argument("--tiny", action="store_true", help="the tiny preset's tower and backbone (smoke run)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--steps", type=int, default=200, help="decode steps per timed loop of the slowdown part")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--sm-shares", type=float, nargs="*", default=[],
                   help="also the encoder on each of these shares of the SMs (EngineArgs.vision_sm_share)")
    p.add_argument("--quick", action="store_true",
                   help="the photo only, fewer repeats (under 2 minutes on an H200, backbone load included)")
    a = p.parse_args()
    if a.quick:
        a.iters, a.steps = min(a.iters, 6), min(a.steps, 60)
    from deepinfer.checkpoint.generator import VISION
    from deepinfer.model.vision import VisionArgs
    preset = "tiny" if a.tiny else a.preset
    v = VisionArgs.from_hf(VISION[preset])
    dim = 5120 if not a.tiny else 32
    if a.device == "cuda":
        print(f"{torch.cuda.get_device_name()}; tower: {v.n_layers} layers x {v.dim}, aligner -> {dim}", flush=True)
    out = dict(device=a.device, preset=preset, tower=dict(layers=v.n_layers, dim=v.dim, text_dim=dim))
    sizes = {k: SIZES[k] for k in list(SIZES)[:1]} if a.quick else SIZES
    out["encode"] = bench_encode(build_tower(v, dim, a.device), v, a.device, a.iters, sizes)
    save(out)
    if not a.skip_decode:
        t = time.perf_counter()
        model = load_backbone(preset, a.device)
        print(f"(backbone {preset} loaded in {time.perf_counter() - t:.0f} s)", flush=True)
        image = make_image(*SIZES["photo 1024x701"], v, 1)
        t = time.perf_counter()
        out["decode"] = bench_decode_slowdown(model, a.device, a.batch if not a.tiny else 2,
                                              a.ctx if not a.tiny else 256, a.steps if not a.tiny else 4, image,
                                              a.sm_shares)
        if out["decode"].get("sm_shares"):
            plot_shares(out["decode"])
        print(f"(decode part {time.perf_counter() - t:.0f} s)", flush=True)
    save(out)


def plot_shares(row: dict) -> None:
    """The decode step's slowdown against the images/s the encoder makes meanwhile, one point per SM share
    (and every SM: the plain stream)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from benchutil import gpu_model, out_dir
    pts = [("every SM", row["images_per_s_meanwhile"], row["slowdown"])] + [
        (f"{r['share']} ({r['num_sms'] or 'all'} SMs)", r["images_per_s_meanwhile"], r["slowdown"])
        for r in row["sm_shares"]]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, x, y in pts:
        ax.plot([x], [y], "o")
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set(xlabel="images encoded per second meanwhile", ylabel="decode step time / alone",
           title=f"vision encoder beside batch-{row['batch']} decode ({gpu_model()})")
    fig.tight_layout()
    path = os.path.join(out_dir(), f"vision_sm_shares_{gpu_model()}.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def save(out: dict) -> None:
    """Written after each part: a run cut short by its time box keeps what it measured."""
    from benchutil import out_dir
    path = os.path.join(out_dir(), "vision_encode.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
