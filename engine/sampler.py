"""Token selection: greedy, temperature, top-k, top-p, per-request seeds, and draft verification.

Draft verification follows speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", arXiv 2211.17192; Chen et al. 2023). An n-gram proposer
puts probability 1 on its draft token ``d``, so the acceptance test ``min(1, p(d) / q(d))``
becomes "accept with probability ``p(d)``", and the residual distribution ``max(0, p - q)``
renormalized is ``p`` with ``d`` removed. Greedy verification accepts while the draft equals the
argmax of the masked target logits; either way the output distribution equals that of plain
decoding.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from engine.logits_process import process_logits_, top_logprobs
from engine.request import Request


def default_seed(base_seed: int, request_id: str) -> int:
    """Seed of a request that gives none: the engine's base seed and a BLAKE2b digest of its id.

    A stable digest, not Python's per-process salted ``hash``: every replica derives the same
    seed for the same request id, so a request retried on another replica (``service.cluster``)
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


def _probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Sampling distribution of one request over ``logits [n, V]`` (already masked): fp32 ``[n, V]``."""
    p = req.params
    x = logits / max(p.temperature, 1e-5)
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop_sorted = (cum - torch.softmax(sorted_x, dim=-1)) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


class Sampler:
    """Turns masked logits into tokens for every sampled request of a step."""

    def __init__(self, base_seed: int = 0):
        self.base_seed = base_seed

    def __call__(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                 want_logprobs: bool = False) -> SamplerOutput:
        """Pick tokens.

        Args:
            logits: fp32 ``[rows, vocab_size]``, masked; request ``i`` owns ``len(drafts[i]) + 1``
                consecutive rows (one per draft position, then the bonus position). Modified in
                place by the requests' penalties and biases (``engine.logits_process``).
            requests: the sampled requests, in row order.
            drafts: each request's draft tokens (``[]`` when not speculating).
            want_logprobs: also return the log-probability of every returned token (and the
                top alternatives of the requests with ``top_logprobs``), taken from the
                distribution tokens are drawn from at temperature 1: masked, penalized, biased.

        Returns:
            ``SamplerOutput``.
        """
        process_logits_(logits, requests, drafts)
        greedy_ids = torch.argmax(logits, dim=-1).tolist()  # one pass for every row
        logp = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        out: list[list[int]] = []
        out_lp: list[list[float]] | None = [] if want_logprobs else None
        out_top: list[list[list[tuple[int, float]]]] | None = [] if want_logprobs else None
        row = 0
        for req, draft in zip(requests, drafts):
            n = len(draft) + 1
            if req.params.greedy:
                tokens = self._verify_greedy(greedy_ids[row:row + n], draft)
            else:
                tokens = self._verify_sampled(logits[row:row + n], req, draft)
            if out_lp is not None:
                out_lp.append([float(logp[row + j, t]) for j, t in enumerate(tokens)])
                k = req.params.top_logprobs
                out_top.append([top_logprobs(logp[row + j], k) for j in range(len(tokens))] if k else [])
            out.append(tokens)
            row += n
        return SamplerOutput(out, out_lp, out_top)

    @staticmethod
    def _verify_greedy(targets: list[int], draft: list[int]) -> list[int]:
        tokens = []
        for j, d in enumerate(draft):
            if d != targets[j]:
                break
            tokens.append(d)
        tokens.append(targets[len(tokens)])
        return tokens

    def _verify_sampled(self, logits: torch.Tensor, req: Request, draft: list[int]) -> list[int]:
        g = _generator(req, self.base_seed)
        probs = _probs(logits, req)  # [n, V]
        tokens: list[int] = []
        for j, d in enumerate(draft):
            p = probs[j]
            u = torch.rand((), generator=g).item()
            if u < float(p[d]):
                tokens.append(d)
                continue
            residual = p.clone()
            residual[d] = 0.0
            total = residual.sum()
            if total <= 0:  # p was a point mass on d yet u >= 1: cannot happen, but stay safe
                tokens.append(d)
                continue
            tokens.append(int(torch.multinomial(residual / total, 1, generator=g)))
            return tokens
        tokens.append(int(torch.multinomial(probs[len(draft)], 1, generator=g)))
        return tokens
