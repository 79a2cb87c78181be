"""Sampling and structured output: seeded batch-invariant sampling, penalties, logprobs, xgrammar masks.

The engine uses:

    sampler = Sampler(vocab_size, tokenizer_path)            # once (the checkpoint's tokenizer.json)
    sampler.check(params)                                    # admission, any thread: compiles the
                                                             #   constraint; InvalidConstraintError (a 400)
    state = sampler.new_state(params, output_ids_so_far)     # per request (replays a resumed grammar)
    out = sampler.sample(logits, [SamplingRow(state, output_ids, position), ...])   # each step
        # out.token_ids [N] int64; out.logprobs[i]: TokenLogprob(logprob, [(id, lp), ...]) or None

Draft verification: rows j = 0..k of a request carry lookahead=drafts[:j]; call
sample(..., advance=False), then state.accept(accepted tokens). Details in sampler.py / grammar.py;
what batch invariance needs from the model in BATCH_INVARIANCE.md. device_sampling.py draws the same
seeded samples from device tensors alone (positions and drafts of a step still in flight: DSpark's
overlapped verify steps).
"""

from deepinfer.sample.grammar import GrammarState, InvalidConstraintError, StructuredOutput
from deepinfer.sample.sampler import Sampler, SamplerOutput, SamplingRow, SamplingState, TokenLogprob

__all__ = ["GrammarState", "InvalidConstraintError", "Sampler", "SamplerOutput", "SamplingRow",
           "SamplingState", "StructuredOutput", "TokenLogprob"]
