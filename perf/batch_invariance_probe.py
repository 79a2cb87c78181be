"""Where does a prompt's forward pass depend on what is prefilled beside it? Module by module.

Runs prompts of the given lengths through the model once together (one batch) and once each alone,
with forward hooks on every module, under batch_invariant_mode; prints, per prompt, the first modules
(in call order) whose token rows differ between the two runs, and the largest difference. The first
module listed is where batch invariance breaks (everything after inherits it).

    python perf/batch_invariance_probe.py --device cuda --preset small            # random weights on the GPU
    DEEPINFER_KERNELS=ref python perf/batch_invariance_probe.py --device cuda     # torch ops everywhere
    python perf/batch_invariance_probe.py --preset tiny                           # CPU (bit-identical expected)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepinfer.cache.model_caches import ModelCaches  # noqa: E402
from deepinfer.kernels.batch_invariant import batch_invariant_mode  # noqa: E402
from deepinfer.model.loader import load_model  # noqa: E402
from deepinfer.model.simple import make_batch  # noqa: E402


def first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


class Recorder:
    """(module name, nth call) -> the output rows, for outputs with one row per token."""

    def __init__(self, model):
        self.rows, self.order, self.num_tokens, self.calls = {}, [], 0, {}
        for name, mod in model.named_modules():
            if name:
                mod.register_forward_hook(self._hook(name))

    def reset(self, num_tokens: int):
        self.rows, self.order, self.num_tokens, self.calls = {}, [], num_tokens, {}

    def _hook(self, name):
        def hook(_mod, _inp, out):
            t = first_tensor(out)
            if t is None or t.dim() == 0 or t.shape[0] != self.num_tokens or not t.is_floating_point():
                return
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
            key = (name, n)
            self.rows[key] = t.detach().float().clone()
            self.order.append(key)
        return hook


def run(model, rec, prompts, device, block_tokens=64):
    args = model.args
    nb = [(len(p) + block_tokens - 1) // block_tokens for p in prompts]
    caches = ModelCaches.allocate(args, len(prompts), sum(nb), block_tokens, device)
    tables = torch.full((len(prompts), max(nb)), 0, dtype=torch.int64)
    start = 0
    for i, n in enumerate(nb):
        tables[i, :n] = torch.arange(start, start + n)
        start += n
    batch = make_batch([(p, 0, []) for p in prompts], list(range(len(prompts))), tables,
                       args.engram_max_ngram_size, device, "last")
    rec.reset(sum(len(p) for p in prompts))
    with torch.inference_mode(), batch_invariant_mode(True):
        out = model(batch, caches)
    return dict(rec.rows), list(rec.order), out.logits.float()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", type=int, nargs="+", default=[17, 300, 1000])
    ap.add_argument("--show", type=int, default=8, help="differing modules listed per prompt")
    a = ap.parse_args()
    from spec_decode import config_only_checkpoint
    ckpt = config_only_checkpoint(Path(tempfile.mkdtemp()), a.preset)
    torch.manual_seed(0)
    model = load_model(ckpt, device=a.device, progress=False, load_format="dummy")
    rec = Recorder(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in a.lengths]
    together, order, logits = run(model, rec, prompts, a.device)
    offsets = [0]
    for p in prompts:
        offsets.append(offsets[-1] + len(p))
    for i, p in enumerate(prompts):
        alone, _, alone_logits = run(model, rec, [p], a.device)
        diffs = []
        for key in order:
            if key not in alone:
                continue
            x = together[key][offsets[i]:offsets[i + 1]]
            y = alone[key]
            if x.shape != y.shape:
                continue
            d = (x - y).abs().max().item()
            if d > 0:
                diffs.append((key, d, y.abs().max().item()))
        dl = (logits[i] - alone_logits[0]).abs().max().item()
        print(f"\nprompt {i} ({len(p)} tokens): last-token logits differ by {dl:.4g}; "
              f"{len(diffs)} of {sum(1 for k in order if k in alone)} module outputs differ")
        for (name, n), d, scale in diffs[:a.show]:
            print(f"  {name}[{n}]  max|diff| {d:.4g}  (max|x| {scale:.4g})")


if __name__ == "__main__":
    main()
