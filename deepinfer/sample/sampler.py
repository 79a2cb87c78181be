"""The sampler: logits [N, V] fp32 + one SamplingRow per row -> token ids, logprobs.

Per step, for every row (all ops are per row, so a row's result never depends on the batch):

    raw logits --log_softmax--> logprobs / top_logprobs (raw model distribution, as vLLM v1)
      -> presence / frequency penalties over the request's output tokens
      -> grammar bitmask (xgrammar), when the request has a constraint in force
      -> greedy rows: argmax
      -> other rows: / temperature -> top_k -> softmax -> top_p -> min_p -> inverse CDF at u

u is a pure function of (seed, position) (random.py). Inverse-CDF sampling in vocabulary order
needs one uniform per token and no ordering of ties, and every filter is a threshold on values
(k-th largest logit, the top_p cut, min_p * max), so sorting order never matters. No `.sum()`
reductions over a whole vocabulary row (torch's CPU row sums split a single row across threads, so
they are not batch-invariant; measured in tests/sample/test_sampler.py): totals come from sums of
fixed 128-token blocks and cumsums, whose order is fixed.

Filter semantics: top_k keeps logits >= the k-th largest (ties at the cut are kept); top_p keeps the
smallest set of most likely tokens whose mass reaches top_p (ties at the cut kept), computed on the
top_k-filtered, renormalized distribution; min_p keeps probs >= min_p * max prob.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from deepinfer.host_copy import host_tensor
from deepinfer.sample.grammar import GrammarState, InvalidConstraintError, StructuredOutput
from deepinfer.sample.random import ACCEPT, RESIDUAL, resolve_seed, uniforms
from deepinfer.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20
TOP_P_FIRST_K = 1024   # top_p looks at this many candidates before falling back to a full sort
CDF_BLOCK = 128        # inverse-CDF sampling: block sums, then a cumsum inside one block


class TokenLogprob(NamedTuple):
    """One sampled token's logprob and its top alternatives: deepseek-recipe's
    `InferenceChunk.tokens(ids, logprobs=[(lp, [(id, lp), ...]), ...])` entry as is."""

    logprob: float
    top: list[tuple[int, float]]


def raw_logprobs(logits: torch.Tensor):
    """logits [n, V] -> (log_softmax [n, V], its top MAX_TOP_LOGPROBS): the raw model distribution's
    logprobs (as vLLM v1), a fixed k so that a row's alternatives do not depend on the batch."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp, torch.topk(lp, min(MAX_TOP_LOGPROBS, lp.shape[-1]), dim=-1)


def token_logprobs(num_rows: int, idx: list[int], top_n: list[int], sampled: list[float],
                   top_ids: list[list[int]], top_vals: list[list[float]]) -> list[TokenLogprob | None]:
    """Per row of a step: rows idx[j] asked for top_n[j] alternatives (the others None)."""
    out: list[TokenLogprob | None] = [None] * num_rows
    for j, i in enumerate(idx):
        out[i] = TokenLogprob(sampled[j], list(zip(top_ids[j][:top_n[j]], top_vals[j][:top_n[j]])))
    return out


@dataclass
class SamplingState:
    """Per request, made once at admission by Sampler.new_state (which compiles the constraint)."""

    params: SamplingParams
    seed: int                                # resolved: a request without a seed gets a random one
    grammar: GrammarState | None = None

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance the grammar by tokens that are now part of the output (accepted drafts + bonus)."""
        if self.grammar is not None:
            for t in token_ids:
                self.grammar.accept(int(t))


@dataclass
class SamplingRow:
    """One logits row to sample."""

    state: SamplingState
    output_token_ids: Sequence[int] = ()     # the request's generated tokens so far (penalties)
    position: int = 0                        # absolute position of the token being sampled
    lookahead: Sequence[int] = ()            # draft tokens between those and this row (verification:
                                             # row j of a request with drafts d_1..d_k has d_1..d_j)
    draft_id: int = -1                       # speculative sampling (rejection.py, "sampled"): the draft
    draft_probs: torch.Tensor | None = None  # this row verifies, and q [V] it was sampled from

    @property
    def token_history(self) -> Sequence[int]:
        return list(self.output_token_ids) + list(self.lookahead) if self.lookahead else self.output_token_ids


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                                   # [N] int64, CPU
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # per row; None unless asked


class Sampler:
    """Stateless across steps except for the compiled-grammar cache; request state is in SamplingState."""

    def __init__(self, vocab_size: int, tokenizer_path: str | None = None,
                 structured: StructuredOutput | None = None) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_path = tokenizer_path
        self._structured = structured
        self._bitmask = None
        self._batch_matcher = None

    # ---- admission ---------------------------------------------------------------------------
    @property
    def structured(self) -> StructuredOutput:
        """Built on the first constrained request (loading the vocabulary takes ~0.5 s)."""
        if self._structured is None:
            if self.tokenizer_path is None:   # refuse the request, keep serving the others
                raise InvalidConstraintError("structured output is unavailable: the checkpoint has no tokenizer.json")
            self._structured = StructuredOutput.from_tokenizer_file(self.tokenizer_path, self.vocab_size)
        return self._structured

    def check(self, params: SamplingParams) -> None:
        """Admission check from any thread: compiles (and caches) the constraint.
        Raises InvalidConstraintError (an InvalidRequestError, a 400) before anything runs."""
        if params.constraint is not None:
            self.structured.compile(params.constraint)

    def new_state(self, params: SamplingParams, output_token_ids: Sequence[int] = ()) -> SamplingState:
        """The request's sampling state. output_token_ids: tokens already generated (a request
        recomputed after preemption), replayed into the grammar so its masks continue where they
        were. Keep one state per request for its whole life where possible (a seedless request
        draws a fresh seed here). Raises InvalidConstraintError."""
        grammar = None
        if params.constraint is not None:
            grammar = self.structured.new_state(params.constraint, params.stop_token_ids)
            for t in output_token_ids:
                grammar.accept(int(t))
        return SamplingState(params, resolve_seed(params.seed), grammar)

    # ---- one step ----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow], advance: bool = True) -> SamplerOutput:
        """logits [N, V] (N == len(rows)) -> SamplerOutput. With advance, each row's grammar accepts
        its sampled token (the normal decode step). Draft verification passes advance=False and
        rows with `lookahead`, then SamplingState.accept(the accepted tokens)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        logprobs = self._logprobs(logits, rows)
        logits = logits.clone()
        self._apply_penalties(logits, rows)
        self._apply_grammar(logits, rows)
        token_ids = self._draw(logits, rows).cpu()
        if advance:
            for row, tok in zip(rows, token_ids.tolist()):
                if row.state.grammar is not None:
                    row.state.grammar.accept(tok)
        return SamplerOutput(token_ids, self._finish_logprobs(logprobs, token_ids, rows))

    def _logprobs(self, logits: torch.Tensor, rows: list[SamplingRow]):
        idx = [i for i, r in enumerate(rows) if r.state.params.logprobs is not None]
        if not idx:
            return None
        return (idx,) + raw_logprobs(logits[idx])

    def _finish_logprobs(self, logprobs, token_ids: torch.Tensor, rows) -> list[TokenLogprob | None]:
        if logprobs is None:
            return [None] * len(rows)
        idx, lp, top = logprobs
        sampled = lp.gather(1, token_ids[idx].to(lp.device)[:, None])[:, 0]
        return token_logprobs(len(rows), idx, [rows[i].state.params.logprobs for i in idx], sampled.tolist(),
                              top.indices.tolist(), top.values.tolist())

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        idx = [i for i, r in enumerate(rows) if (r.output_token_ids or r.lookahead) and
               (r.state.params.presence_penalty or r.state.params.frequency_penalty)]
        if not idx:
            return
        hist = [rows[i].token_history for i in idx]
        row_of = [j for j, h in enumerate(hist) for _ in h]
        toks = [int(t) for h in hist for t in h]
        counts = torch.zeros(len(idx), logits.shape[1], device=logits.device)
        counts.index_put_((torch.tensor(row_of, device=logits.device), torch.tensor(toks, device=logits.device)),
                          torch.ones(len(toks), device=logits.device), accumulate=True)
        freq = torch.tensor([rows[i].state.params.frequency_penalty for i in idx], device=logits.device)
        pres = torch.tensor([rows[i].state.params.presence_penalty for i in idx], device=logits.device)
        logits[idx] -= freq[:, None] * counts + pres[:, None] * (counts > 0)

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        if not any(r.state.grammar is not None for r in rows):
            return
        import xgrammar as xgr

        n, vocab = logits.shape
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 16), vocab)
        active, plain = [], []
        for i, r in enumerate(rows):
            g = r.state.grammar
            if g is None:
                continue
            if r.lookahead:               # draft rows: tentative accept, fill, roll back (sequential)
                if g.fill_bitmask(self._bitmask, i, r.lookahead):
                    active.append(i)
            elif g.active:
                plain.append(i)
        if len(plain) > 1:                # one call, xgrammar's threads, the GIL released
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            self._batch_matcher.batch_fill_next_token_bitmask(
                [rows[i].state.grammar.matcher for i in plain], self._bitmask, plain)
        elif plain:
            rows[plain[0]].state.grammar.fill_bitmask(self._bitmask, plain[0])
        active += plain
        if not active:
            return
        mask = self._bitmask[:n].to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, indices=active)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        out = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.state.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.state.params.greedy]
        take = lambda idx: logits if len(idx) == len(rows) else logits[idx]   # noqa: E731 - no copy when all
        if greedy:
            out[greedy] = take(greedy).argmax(dim=-1)
        spec = [i for i in random if rows[i].draft_probs is not None]
        plain = [i for i in random if rows[i].draft_probs is None]
        if plain:
            out[plain] = sample_rows(take(plain), [rows[i].state.params for i in plain],
                                     uniforms([rows[i].state.seed for i in plain], [rows[i].position for i in plain]))
        if spec:
            out[spec] = self._draw_speculative(take(spec), [rows[i] for i in spec])
        return out

    @staticmethod
    def _draw_speculative(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows that verify a sampled draft: accept it with min(1, p/q), else resample the residual."""
        from deepinfer.sample.rejection import speculative_rows
        seeds, positions = [r.state.seed for r in rows], [r.position for r in rows]
        probs = filtered_probs(logits, [r.state.params for r in rows])
        drafts = host_tensor([r.draft_id for r in rows], torch.int64, logits.device)
        q = torch.stack([r.draft_probs for r in rows]).to(logits.device)
        return speculative_rows(probs, drafts, q, uniforms(seeds, positions, ACCEPT),
                                uniforms(seeds, positions, RESIDUAL))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """logits [n, V] fp32 (masked/penalized; consumed: scaled in place), u [n] float64 in [0, 1)
    -> [n] int64 token ids."""
    return inverse_cdf(filtered_probs(logits, params), u.to(logits.device))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], no_host_read: bool = False) -> torch.Tensor:
    """logits [n, V] fp32 (consumed) -> [n, V] probabilities after temperature, top_k, top_p, min_p;
    rows at temperature > 0 only. Not renormalized after the cuts (inverse_cdf scales by the total;
    row_totals gives it). no_host_read (overlapped verify steps on CUDA): the same values without
    reading the device on the host (top_p sorts every row whole)."""
    temp = host_tensor([p.temperature for p in params], torch.float32, logits.device)
    x = logits.div_(temp[:, None])
    _top_k(x, [p.top_k for p in params])
    probs = torch.softmax(x, dim=-1)                                                  # [n, V]
    _top_p(probs, [p.top_p for p in params], no_host_read)
    _min_p(probs, [p.min_p for p in params])
    return probs


def row_totals(probs: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """[n, V] -> [n] float64 row sums in a fixed order (block sums, then a cumsum): batch-invariant."""
    n, vocab = probs.shape
    pad = (-vocab) % block
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, block)
    return blocks.sum(-1).to(torch.float64).cumsum(-1)[:, -1]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The first token whose cumulative probability (vocabulary order) exceeds u * total; [n] int64.

    Two levels, to avoid a full-vocabulary cumsum (slow on CPU): block sums ([n, V/block], each a
    fixed-order sum of `block` contiguous values, many outputs per row so never split differently by
    the batch size), a cumsum over the blocks, then a cumsum inside the chosen block. Tokens of
    probability 0 are never chosen (clamped to the last positive block / token).
    """
    n, vocab = probs.shape
    pad = (-vocab) % block
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(n, -1, block)   # [n, nb, block]
    bcdf = blocks.sum(-1).to(torch.float64).cumsum(-1)                                # [n, nb]
    target = u[:, None] * bcdf[:, -1:]                                                # [n, 1]
    b = torch.searchsorted(bcdf, target, right=True)
    b = torch.minimum(b, _last_positive(bcdf.diff(dim=-1, prepend=torch.zeros_like(bcdf[:, :1]))))
    prev = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(n, 1, block))[:, 0]                  # [n, block]
    icdf = prev + inner.to(torch.float64).cumsum(-1)                                  # [n, block]
    j = torch.minimum(torch.searchsorted(icdf, target, right=True), _last_positive(inner))
    return (b * block + j)[:, 0]


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """[n, m] -> [n, 1]: index of the last entry > 0 (0 if none)."""
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x > 0, idx, torch.zeros_like(idx)).amax(dim=-1, keepdim=True)


def _row_index(idx: list[int], x: torch.Tensor) -> torch.Tensor:
    """The rows idx of x as a device index (a Python list index is copied to the device synchronously,
    which an overlapped verify step must not do)."""
    return host_tensor(idx, torch.int64, x.device)


def _top_k(x: torch.Tensor, ks: list[int]) -> None:
    idx = [i for i, k in enumerate(ks) if 0 < k < x.shape[-1]]
    if not idx:
        return
    k = host_tensor([ks[i] for i in idx], torch.int64, x.device)
    rows = _row_index(idx, x)
    sub = x[rows]
    vals = torch.topk(sub, max(ks[i] for i in idx), dim=-1).values                    # [m, kmax], descending
    kth = vals.gather(1, (k - 1)[:, None])
    x[rows] = sub.masked_fill(sub < kth, float("-inf"))


def _top_p(probs: torch.Tensor, ps: list[float], no_host_read: bool = False) -> None:
    idx = [i for i, p in enumerate(ps) if p < 1.0]
    if not idx:
        return
    p = host_tensor([ps[i] for i in idx], torch.float64, probs.device)[:, None]
    rows = _row_index(idx, probs)
    sub = probs[rows]
    vals = torch.topk(sub, min(TOP_P_FIRST_K, sub.shape[-1]), dim=-1).values          # [m, K] descending
    mass = torch.cumsum(vals, dim=-1, dtype=torch.float64)
    short = mass[:, -1] < p[:, 0]
    if no_host_read:   # which rows' nucleus is wider than K is on the device: sort every row, same cut
        full = torch.sort(sub, dim=-1, descending=True).values
        wide = _cut_values(full, torch.cumsum(full, dim=-1, dtype=torch.float64), p)
        probs[rows] = sub.masked_fill(sub < torch.where(short[:, None], wide, _cut_values(vals, mass, p)), 0.0)
        return
    if bool(short.any()):   # the nucleus is wider than K: sort those rows whole
        full = torch.sort(sub[short], dim=-1, descending=True).values
        cut = _cut_values(full, torch.cumsum(full, dim=-1, dtype=torch.float64), p[short])
    cut_all = _cut_values(vals, mass, p)
    if bool(short.any()):
        cut_all[short] = cut
    probs[rows] = sub.masked_fill(sub < cut_all, 0.0)


def _cut_values(vals: torch.Tensor, mass: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The smallest kept probability: vals at the first index where the cumulative mass reaches p."""
    j = torch.searchsorted(mass, p).clamp_(max=vals.shape[-1] - 1)                    # [m, 1]
    return vals.gather(1, j)


def _min_p(probs: torch.Tensor, ms: list[float]) -> None:
    idx = [i for i, m in enumerate(ms) if m > 0.0]
    if not idx:
        return
    m = host_tensor([ms[i] for i in idx], torch.float32, probs.device)[:, None]
    rows = _row_index(idx, probs)
    sub = probs[rows]
    probs[rows] = sub.masked_fill(sub < m * sub.amax(dim=-1, keepdim=True), 0.0)
