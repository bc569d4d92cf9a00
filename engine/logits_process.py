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
"""

from __future__ import annotations

import torch

from stencil.engine.request import Request, SamplingParams

BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value
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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions
MAX_LOGIT_BIAS = 1024  # entries per request
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0


def check_logits_params(params: SamplingParams, vocab_size: int) -> None:
    """Refuse penalties, biases and ``top_logprobs`` out of range.

    Args:
        params: the request's parameters.
        vocab_size: the model's vocabulary size (token ids of ``logit_bias`` must be below it).

    Raises:
        LogitsParamError: the message names the field (``LLMEngine.check_request`` turns it
            into an ``EngineError``, a 400).
    """
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not -2.0 <= v <= 2.0:  # NaN fails too
            raise LogitsParamError(f"{name} must be between -2 and 2, got {v}", name)
    if not MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY:
        # Dividing a logit by a penalty near 0 overflows float32 to inf, and the sampler's softmax
        # to NaN (the API fuzzer found 8e-258): the range keeps every processed logit finite.
        raise LogitsParamError(f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and "
                               f"{MAX_REPETITION_PENALTY}, got {params.repetition_penalty}", "repetition_penalty")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise LogitsParamError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {params.top_logprobs}",
                               "top_logprobs")
    bias = params.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise LogitsParamError(f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}", "logit_bias")
    for token, value in bias.items():
        if not isinstance(token, int) or not 0 <= token < vocab_size:
            raise LogitsParamError(f"logit_bias: token id {token!r} is not in this model's vocabulary "
                                   f"(0..{vocab_size - 1})", "logit_bias")
        if not isinstance(value, (int, float)) or not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise LogitsParamError(f"logit_bias: the bias of token {token} must be between -100 and 100, "
                                   f"got {value}", "logit_bias")


class LogitsParamError(ValueError):
    """A penalty, bias or ``top_logprobs`` value out of range.

    Attributes:
        field: the ``SamplingParams`` field at fault (also named in the message).
    """

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field
