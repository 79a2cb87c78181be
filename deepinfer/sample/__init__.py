"""Sampling and structured output: seeded batch-invariant sampling, penalties, logprobs, xgrammar masks.

The engine's runner uses three names:

    sampler = Sampler(vocab_size, tokenizer_path)            # once
    state = sampler.new_state(params)                        # at admission; InvalidConstraintError -> 400
    out = sampler.sample(logits, [SamplingRow(state, output_ids, position), ...])   # each step
"""

from deepinfer.sample.grammar import GrammarState, InvalidConstraintError, StructuredOutput
from deepinfer.sample.sampler import Sampler, SamplerOutput, SamplingRow, SamplingState, TokenLogprob

__all__ = ["GrammarState", "InvalidConstraintError", "Sampler", "SamplerOutput", "SamplingRow",
           "SamplingState", "StructuredOutput", "TokenLogprob"]
