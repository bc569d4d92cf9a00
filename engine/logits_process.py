"""Per-request logits processing before sampling: repetition, frequency and presence penalties,
then ``logit_bias``.

Applied to the grammar-masked logits of every row a request owns in a step (one row per draft
position plus the bonus row), so speculation stays exact: row ``j`` of a request with drafts
``d`` sees the penalties of its output tokens followed by ``d[:j]``, the very context a decoded
token at that position would see. Every operation is elementwise within a row and reads only the
row's own request, so a row gets the same values whatever else shares the step (batch
invariance). A token the grammar masked (``-inf``) stays ``-inf``: neither a bias nor a
penalty re-allows it.

Definitions (OpenAI API reference, "Chat > Create", and its "Parameter details" guide; the
repetition penalty is CTRL's, Keskar et al. 2019, arXiv 1909.05858, as vLLM and transformers
apply it):

- frequency / presence: ``logit[t] -= frequency * c[t] + presence * (c[t] > 0)``, ``c[t]`` the
  count of ``t`` among the output tokens so far (forced and accepted draft tokens included).
- repetition: for every token seen in the prompt or the output, ``logit / r`` where the logit is
  positive, ``logit * r`` where it is not.
- logit_bias: ``logit[t] += bias[t]``; a bias of exactly -100 or +100 is a ban or an exclusive
  choice, written as ``∓BAN`` (finite, far beyond any logit): when the grammar leaves only banned
  tokens, the grammar wins and one of them is still picked (a row never runs out of tokens).

The values' ranges are checked once, where the parameters are made (``SamplingParams.verify``).
"""

from __future__ import annotations

import torch

from stencil.engine.request import BIAS_LIMIT, Request, SamplingParams

BAN = 1.0e4  # what ±100 becomes: exp(-1e4) underflows to 0 next to any ordinary logit


def needs_processing(params: SamplingParams) -> bool:
    """Whether a request asks for any of the adjustments of this module."""
    return bool(params.logit_bias) or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0 \
        or params.repetition_penalty != 1.0


def process_logits_(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor:
    """Apply penalties and biases in place to the rows of the requests that ask for them.

    Args:
        logits: fp32 ``[rows, V]`` (masked); request ``i`` owns ``len(drafts[i]) + 1``
            consecutive rows, in order.
        requests: the sampled requests, in row order.
        drafts: each request's draft tokens this step.

    Returns:
        ``logits`` (modified in place).
    """
    row = 0
    for req, draft in zip(requests, drafts):
        n = len(draft) + 1
        if needs_processing(req.params):
            _process_request_(logits[row:row + n], req, draft)
        row += n
    return logits


def _process_request_(rows: torch.Tensor, req: Request, draft: list[int]) -> None:
    """Rows ``[n, V]`` of one request: row ``j`` follows the output and ``draft[:j]``."""
    p = req.params
    n, vocab = rows.shape
    if p.frequency_penalty or p.presence_penalty:
        counts = _counts(req.output_token_ids, draft, n, vocab)  # [n, V]
        rows -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(rows.dtype)
    if p.repetition_penalty != 1.0:
        seen = _counts(req.all_token_ids, draft, n, vocab) > 0  # [n, V], prompt included
        penalized = torch.where(rows > 0, rows / p.repetition_penalty, rows * p.repetition_penalty)
        rows.copy_(torch.where(seen, penalized, rows))
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        values = torch.tensor([_bias_value(v) for v in p.logit_bias.values()], dtype=rows.dtype)
        rows[:, ids] += values  # -inf + bias stays -inf: the grammar keeps its word


def _bias_value(v: float) -> float:
    if v <= -BIAS_LIMIT:
        return -BAN
    if v >= BIAS_LIMIT:
        return BAN
    return float(v)


def _counts(tokens: list[int], draft: list[int], n: int, vocab: int) -> torch.Tensor:
    """fp32 ``[n, vocab]``: row ``j`` counts ``tokens + draft[:j]``."""
    ids = torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.long)
    base = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
    counts = base.unsqueeze(0).repeat(n, 1)
    for j, d in enumerate(draft[:n - 1]):
        if 0 <= d < vocab:
            counts[j + 1:, d] += 1.0
    return counts


def top_logprobs(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one row of log-probabilities, most likely first.

    Tokens the grammar forbids (``-inf``) are never listed, so fewer than ``k`` come back where
    the grammar allows fewer. Ties keep the lower token id first (``torch.topk`` is not stable).

    Args:
        logp: fp32 ``[V]`` log-probabilities.
        k: how many (``0`` = none).
    """
    if k <= 0:
        return []
    values, ids = torch.topk(logp, min(k, logp.shape[-1]))
    pairs = [(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist()) if v != float("-inf")]
    pairs.sort(key=lambda p: (-p[1], p[0]))
    return pairs
