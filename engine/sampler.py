"""Token selection: greedy, temperature, min-p, top-k, top-p, per-request seeds, and draft verification.

A sampled row's distribution: the grammar-masked, penalized and biased logits
(``stencil.engine.logits_process``) divided by the temperature, then min-p, top-k and top-p
(``_filtered``), then softmax. Draft positions go through the same rows, so verification draws
from the very distribution decoding without drafts draws from.

Draft verification keeps the output distribution of plain decoding, as speculative sampling
does (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", arXiv
2211.17192; Chen et al. 2023): every proposer here puts probability 1 on its draft token ``d``,
for which that rule accepts with probability ``p(d)`` and otherwise draws from ``p`` without
``d``. Sampled verification gets the same by coupling instead (``Sampler._verify_sampled``):
each position draws its token from the uniform decoding without drafts would use there, and a
draft token stands while it equals the draw; so a seeded request's tokens do not depend on
whether it drafted. Greedy verification accepts while the draft equals the argmax of the masked
target logits.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np
import torch

from stencil.engine.logits_process import process_logits_, top_logprobs
from stencil.engine.request import Request


def default_seed(base_seed: int, request_id: str) -> int:
    """Seed of a request that gives none: the engine's base seed and a BLAKE2b digest of its id.

    A stable digest, not Python's per-process salted ``hash``: every replica derives the same
    seed for the same request id, so a request retried on another replica (``stencil.service.cluster``)
    samples the same tokens. Returns an int in ``[0, 2**63)``.
    """
    digest = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return (base_seed * 1_000_003 + digest) & 0x7FFF_FFFF_FFFF_FFFF
class SamplerOutput(NamedTuple):
    """Per sampled request, in row order.

    Attributes:
        tokens: accepted drafts, then one sampled token.
        logprobs: the log-probability of each of ``tokens`` (or None when nobody asked).
        top_logprobs: per token of ``tokens``, the most likely alternatives at its position as
            ``(token id, logprob)``, best first (``[]`` for requests that did not ask; None
            when nobody asked).
    """

    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None


def _generator(req: Request, base_seed: int) -> torch.Generator:
    if req.generator is None:
        seed = req.params.seed
        if seed is None:
            seed = default_seed(base_seed, req.request_id)
        g = torch.Generator(device="cpu")
        g.manual_seed(int(seed))
        req.generator = g
    return req.generator


def _filtered(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``x [n, V]`` (masked, temperature applied) with min-p, top-k and top-p filtering,
    per row, in that order (vLLM's); a token filtered out becomes ``-inf``.

    Args:
        top_k: int64 ``[n]``; 0 (or >= V) keeps every token.
        top_p: fp32 ``[n]``; 1 keeps every token.
        min_p: fp32 ``[n]``, or None (0 for every row); 0 keeps every token. Keeps a token whose
            probability is at least ``min_p`` times the row's largest: ``x >= max(x) + log(min_p)``
            (the softmax's normalizer cancels). The mask was applied first, so the largest is
            that of an allowed token: a masked-out token never sets the threshold.

    Every operation is row-wise (``max``, ``topk``, ``sort``, ``softmax``, ``cumsum`` along the
    last dim), so a row gets the same values whatever rows share the call: a draft position's
    row is filtered as decoding that position without drafts would filter it.
    """
    vocab = x.shape[-1]
    if min_p is not None:
        m_rows = (min_p > 0).nonzero().flatten()
        if m_rows.numel():
            sub = x[m_rows]
            floor = sub.max(dim=-1, keepdim=True).values + torch.log(min_p[m_rows]).unsqueeze(1)
            x[m_rows] = sub.masked_fill(sub < floor, float("-inf"))  # the largest always stays
    k_rows = ((top_k > 0) & (top_k < vocab)).nonzero().flatten()
    if k_rows.numel():
        sub = x[k_rows]
        ks = top_k[k_rows]
        kth = torch.topk(sub, int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        x[k_rows] = sub.masked_fill(sub < kth, float("-inf"))
    p_rows = (top_p < 1.0).nonzero().flatten()
    if p_rows.numel():
        sub = x[p_rows]
        sorted_x, idx = torch.sort(sub, dim=-1, descending=True)
        sm = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (sm.cumsum(dim=-1) - sm) >= top_p[p_rows].unsqueeze(1)
        # A top_p below fp32's smallest value (1e-101 is a valid float64 > 0) is 0 here: the
        # comparison above would then drop every token, and an all -inf row has no distribution.
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x[p_rows] = sub.masked_fill(drop, float("-inf"))
    return x


def _probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Sampling distribution of one request over ``logits [n, V]`` (already masked): fp32 ``[n, V]``."""
    p = req.params
    n = logits.shape[0]
    x = logits / max(p.temperature, 1e-5)
    x = _filtered(x, torch.full((n,), p.top_k, dtype=torch.long), torch.full((n,), p.top_p, dtype=torch.float32),
                  torch.full((n,), p.min_p, dtype=torch.float32))
    return torch.softmax(x, dim=-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [n, V]`` from uniforms ``u [n]`` in ``[0, 1)``: the first
    token whose cumulative mass exceeds ``u`` times the row's total (inverse transform sampling).

    A token of probability 0 is never chosen: its cumulative mass equals its predecessor's.
    Returns int64 ``[n]``.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    idx = torch.searchsorted(cdf, u.unsqueeze(1).to(cdf.dtype) * total, right=True)
    # u * total can round up to total itself: then the last token with mass is the answer.
    last = torch.searchsorted(cdf, total.contiguous(), right=False)
    return torch.minimum(idx, last).squeeze(1)


class Sampler:
    """Turns masked logits into tokens for every sampled request of a step.

    The whole batch is handled with a few tensor operations: one argmax over every row (greedy
    requests), and for the sampled rows one temperature division, min-p/top-k/top-p pass and softmax,
    then one inverse-CDF draw per request from its own generator (one uniform each, so a
    request draws the same tokens whatever else is in the batch). Only drafts under sampling
    (the rejection test) and logprobs go request by request.
    """

    def __init__(self, base_seed: int = 0):
        self.base_seed = base_seed

    def __call__(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                 want_logprobs: bool = False) -> SamplerOutput:
        """Pick tokens.

        Args:
            logits: fp32 ``[rows, vocab_size]``, masked; request ``i`` owns ``len(drafts[i]) + 1``
                consecutive rows (one per draft position, then the bonus position). Modified in
                place by the requests' penalties and biases (``stencil.engine.logits_process``).
            requests: the sampled requests, in row order.
            drafts: each request's draft tokens (``[]`` when not speculating).
            want_logprobs: also return the log-probability of every returned token (and the
                top alternatives of the requests with ``top_logprobs``), taken from the
                distribution tokens are drawn from at temperature 1: masked, penalized, biased.

        Returns:
            ``SamplerOutput``.
        """
        process_logits_(logits, requests, drafts)
        # One pass for every row; numpy's argmax is vectorized (3-4x torch's on CPU) and, like
        # torch's, returns the first of equal maxima.
        if logits.device.type == "cpu":
            greedy_ids = np.argmax(logits.numpy(), axis=-1).tolist()
        else:
            greedy_ids = torch.argmax(logits, dim=-1).tolist()
        logp = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        starts: list[int] = []
        row = 0
        for draft in drafts:
            starts.append(row)
            row += len(draft) + 1
        sampled = [i for i, req in enumerate(requests) if not req.params.greedy]
        drawn = self._sample(logits, requests, drafts, starts, sampled) if sampled else {}
        out: list[list[int]] = []
        out_lp: list[list[float]] | None = [] if want_logprobs else None
        out_top: list[list[list[tuple[int, float]]]] | None = [] if want_logprobs else None
        for i, (req, draft) in enumerate(zip(requests, drafts)):
            row = starts[i]
            if i in drawn:
                tokens = drawn[i]
            else:
                tokens = self._verify_greedy(greedy_ids[row:row + len(draft) + 1], draft)
            if out_lp is not None:
                out_lp.append([float(logp[row + j, t]) for j, t in enumerate(tokens)])
                k = req.params.top_logprobs
                out_top.append([top_logprobs(logp[row + j], k) for j in range(len(tokens))] if k else [])
            out.append(tokens)
        return SamplerOutput(out, out_lp, out_top)

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                starts: list[int], sampled: list[int]) -> dict[int, list[int]]:
        """Tokens of the sampled (non-greedy) requests, by request index."""
        rows: list[int] = []
        temps: list[float] = []
        ks: list[int] = []
        ps: list[float] = []
        mins: list[float] = []
        for i in sampled:
            p = requests[i].params
            n = len(drafts[i]) + 1
            rows.extend(range(starts[i], starts[i] + n))
            temps.extend([max(p.temperature, 1e-5)] * n)
            ks.extend([p.top_k] * n)
            ps.extend([p.top_p] * n)
            mins.extend([p.min_p] * n)
        x = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        x /= torch.tensor(temps, dtype=x.dtype, device=x.device).unsqueeze(1)
        x = _filtered(x, torch.tensor(ks, dtype=torch.long, device=x.device),
                      torch.tensor(ps, dtype=torch.float32, device=x.device),
                      torch.tensor(mins, dtype=torch.float32, device=x.device))
        probs = torch.softmax(x, dim=-1)
        out: dict[int, list[int]] = {}
        plain: list[int] = []  # rows (in probs) of requests without drafts: one draw each, batched
        plain_reqs: list[int] = []
        at = 0
        for i in sampled:
            n = len(drafts[i]) + 1
            if drafts[i]:
                out[i] = self._verify_sampled(probs[at:at + n], requests[i], drafts[i])
            else:
                plain.append(at)
                plain_reqs.append(i)
            at += n
        if plain:
            u = torch.stack([torch.rand((), generator=_generator(requests[i], self.base_seed))
                             for i in plain_reqs])
            picked = _inverse_cdf(probs[torch.tensor(plain, dtype=torch.long, device=probs.device)], u.to(probs.device))
            for i, t in zip(plain_reqs, picked.tolist()):
                out[i] = [t]
        return out

    @staticmethod
    def _verify_greedy(targets: list[int], draft: list[int]) -> list[int]:
        tokens = []
        for j, d in enumerate(draft):
            if d != targets[j]:
                break
            tokens.append(d)
        tokens.append(targets[len(tokens)])
        return tokens

    def _draw(self, p: torch.Tensor, g: torch.Generator) -> int:
        """One token from the distribution ``p [V]`` (not necessarily normalized)."""
        u = torch.rand((), generator=g).reshape(1)  # the same draw as a request without drafts
        return int(_inverse_cdf(p.unsqueeze(0), u.to(p.device))[0])

    def _verify_sampled(self, probs: torch.Tensor, req: Request, draft: list[int]) -> list[int]:
        """Sampled verification of ``draft`` under ``probs [len(draft) + 1, V]``, drawing what
        decoding without drafts would draw.

        Position ``j`` takes the inverse-CDF draw of the generator's next uniform, the very
        draw a request without drafts makes for that token; the draft token stands while it
        equals that draw, and the first draw that differs is the last token. Each token is
        exactly distributed as ``probs[j]``, and a draft token is accepted with probability
        ``probs[j][d]``: what Leviathan et al.'s rejection rule (2023, "Fast Inference from
        Transformers via Speculative Decoding") gives a deterministic draft, which every drafter
        here proposes (n-grams, prompt lookup, forced text). Unlike that rule, which spends a
        uniform on the acceptance test and another on the residual, every output token spends
        one uniform, so a seeded request draws the same tokens whether or not, and however
        much, it drafted (given the same logits: the native kernels' rows do not depend on the
        batch)."""
        g = _generator(req, self.base_seed)
        tokens: list[int] = []
        for j in range(len(draft) + 1):
            t = self._draw(probs[j], g)
            tokens.append(t)
            if j == len(draft) or t != draft[j]:
                break
        return tokens
