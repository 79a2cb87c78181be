"""deepinfer-score: reference-comparable outputs of a checkpoint on a set of prompts.

For each prompt: the fp32 logits of the last prompt position, then N one-token decode steps (greedy,
or feeding the tokens recorded in --teacher-force's file), the DSpark drafts / draft logits /
confidences of every decode step, the Engram hash ids of the prompt and, with --dump-hidden, the
prefill residual stream entering each layer and each attention output; written in the candidate
layout of ../shared/fixtures/README.md ("dsv41-parity-candidate/1").
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="deepinfer-score", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompts", required=True, help="prompts.json ({'prompts': [{'ids': [...]}, ...]})")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--teacher-force", help="expected.npz whose p{i}_fed_tokens / p{i}_tokens are fed")
    p.add_argument("--dump-hidden", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-dspark", action="store_true", help="skip the DSpark drafts")
    p.add_argument("--expert-format", choices=("fp8", "fp4"), default="fp8",
                   help="the routed experts' stacks on CUDA (EngineArgs.expert_format)")
    p.add_argument("--index-k-alias", choices=("auto", "on", "off"), default="auto",
                   help="reproduce the official reference's decode-time index-key aliasing "
                        "(ModelArgs.emulate_index_k_alias). auto: on when --teacher-force's file was "
                        "produced by DeepSeek's reference code (its meta names it), else off")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="score on N expert-parallel ranks (deepinfer/parallel/; gloo processes on a CPU): "
                        "prompt i runs on rank i mod N, every rank holding only its share of the experts")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: tiny models gain nothing from more; 0 = torch default)")
    return p.parse_args(argv)


def load_prompts(path: str) -> list[list[int]]:
    data = json.load(open(path))
    prompts = data["prompts"] if isinstance(data, dict) else data
    return [list(map(int, p["ids"] if isinstance(p, dict) else p)) for p in prompts]


def score_prompt(model, ids: list[int], steps: int, forced: dict | None, dump_hidden: bool, dspark: bool,
                 draft_steps: list[int], device) -> dict:
    from deepinfer.model.simple import SequenceRunner

    P = len(ids)
    runner = SequenceRunner(model, P + steps + 8, device)
    out = runner.step(ids, dump_hidden=dump_hidden)
    res = {"prompt_ids": np.array(ids, dtype=np.int64), "prefill_logits": out.logits[-1].float().cpu().numpy()}
    if out.hash_ids is not None:
        res["engram_hash_ids"] = out.hash_ids.cpu().numpy()
    if dump_hidden:
        res["hidden"] = out.hidden.cpu().numpy()
        res["attn_out"] = out.attn_out.cpu().numpy()
    use_dspark = dspark and model.args.dspark_block_size and out.main_hidden is not None
    if use_dspark:
        runner.dspark_absorb(out.main_hidden, torch.arange(P, device=device))
    tokens = [int(out.logits[-1].argmax())]
    fed, dec_logits, drafts, confs, dlogits = [], [], [], [], []
    for k in range(steps):
        tok = int(forced["fed"][k]) if forced else tokens[k]
        fed.append(tok)
        out = runner.step([tok])
        logits = out.logits[-1].float()
        dec_logits.append(logits.cpu().numpy())
        tokens.append(int(logits.argmax()))
        if use_dspark:
            runner.dspark_absorb(out.main_hidden, torch.tensor([P + k], device=device))
            anchor = int(forced["tokens"][k + 1]) if forced else tokens[k + 1]
            d = runner.dspark_propose(anchor, P + k)
            drafts.append(d.draft_ids[0].cpu().numpy())
            confs.append(d.confidence[0].float().cpu().numpy())
            if k in draft_steps:
                dlogits.append(d.logits[0].float().cpu().numpy())
    res.update(fed_tokens=np.array(fed, dtype=np.int64), tokens=np.array(tokens, dtype=np.int64),
               decode_logits=np.stack(dec_logits) if dec_logits else np.zeros((0, model.args.vocab_size), np.float32))
    if use_dspark and drafts:
        res.update(draft_tokens=np.stack(drafts).astype(np.int64), draft_confidence=np.stack(confs),
                   draft_logits=np.stack(dlogits))
    return res


def _score_parallel(a, prompts, forced, draft_steps, alias) -> list[dict]:
    from deepinfer.config import EngineArgs
    from deepinfer.parallel.executor import MultiprocExecutor
    from deepinfer.worker.rank import ModelFacts
    args = EngineArgs(checkpoint=a.checkpoint, device=a.device, data_parallel_size=a.data_parallel_size,
                      max_num_seqs=1, num_cache_blocks=1, worker_threads=a.threads or None,
                      model_overrides={"emulate_index_k_alias": alias})
    ex = MultiprocExecutor(args, ModelFacts.read(args))
    try:
        return ex.score(prompts, forced, {"steps": a.decode_steps, "dump_hidden": a.dump_hidden,
                                          "dspark": not a.no_dspark, "draft_steps": draft_steps})
    finally:
        ex.shutdown()


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from deepinfer.model.args import ConfigError
    from deepinfer.model.loader import CheckpointError, load_model

    t0 = time.time()
    forced_npz = np.load(a.teacher_force) if a.teacher_force else None
    forced_meta = json.loads(str(forced_npz["meta_json"])) if forced_npz is not None and "meta_json" in forced_npz else {}
    alias = a.index_k_alias == "on" or (a.index_k_alias == "auto" and "reference" in forced_meta)
    prompts = load_prompts(a.prompts)
    draft_steps = [0, a.decode_steps - 1] if a.decode_steps > 0 else []
    if "draft_logit_steps" in forced_meta:
        draft_steps = [s for s in forced_meta["draft_logit_steps"] if s < a.decode_steps] or draft_steps
    forced = [None if forced_npz is None else {"fed": forced_npz[f"p{i}_fed_tokens"], "tokens": forced_npz[f"p{i}_tokens"]}
              for i in range(len(prompts))]
    try:
        if a.data_parallel_size > 1:
            results = _score_parallel(a, prompts, forced, draft_steps, alias)
        else:
            model = load_model(a.checkpoint, a.device, progress=sys.stderr.isatty(), emulate_index_k_alias=alias,
                               expert_format=a.expert_format)
            results = [score_prompt(model, ids, a.decode_steps, f, a.dump_hidden, not a.no_dspark, draft_steps,
                                    torch.device(a.device)) for ids, f in zip(prompts, forced)]
    except (CheckpointError, ConfigError, ValueError) as e:
        print(f"deepinfer-score: {e}", file=sys.stderr)
        return 2
    out = {}
    for i, res in enumerate(results):
        out.update({f"p{i}_{k}": v for k, v in res.items()})
    meta = {"format": "dsv41-parity-candidate/1", "engine": "deepinfer", "teacher_forced": forced_npz is not None,
            "decode_steps": a.decode_steps, "draft_logit_steps": draft_steps, "device": a.device,
            "emulate_index_k_alias": alias, "data_parallel_size": a.data_parallel_size,
            "seconds": round(time.time() - t0, 2)}
    out["meta_json"] = np.array(json.dumps(meta))
    np.savez(a.out, **out)
    print(f"deepinfer-score: {len(prompts)} prompts, {a.decode_steps} decode steps -> {a.out} "
          f"({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
