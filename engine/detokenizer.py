"""Incremental detokenization that never emits half a UTF-8 character, with stop strings."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Decoding a token alone can differ from decoding it in context (SentencePiece drops a
    leading space at the start of a string; byte-level BPE splits multi-byte characters over
    tokens). So each delta decodes a short window ``tokens[prefix_offset:]`` and subtracts the
    decoding of ``tokens[prefix_offset:read_offset]``; while the window ends inside a UTF-8
    character (decoded as U+FFFD) nothing is emitted. Text that could still become a stop string
    is held back until it cannot.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (may include held-back text)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False  # a stop string was found; text is cut before it

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now final (may be "")."""
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """Return whatever is still held back (complete characters only)."""
        if not self.stopped and self.read_offset < len(self.tokens):
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            window = self._decode(self.tokens[self.prefix_offset:]).rstrip("\ufffd")
            if len(window) > len(prefix):
                self.text += window[len(prefix):]
            self.read_offset = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        end = len(self.text)
        if self.stop and not self.stopped and not final:
            end -= self._held_back()
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    @property
    def output_text(self) -> str:
        return self.text[:self.emitted]


class ReasoningDetokenizer:
    """The text of an output with a reasoning region (``SamplingParams.reasoning``), split in two.

    Output tokens are routed by where the request's matcher put them
    (``stencil.grammar.reasoning.ReasoningMatcher``: ``reasoning_start``, ``reasoning_end``,
    ``answer_start``): the reasoning's own tokens to one ``IncrementalDetokenizer`` (with the end
    marker's text as its stop string, so a marker the reasoning's text completed is cut off, and
    a partial one is held back until it is settled), the answer's to another (the request's stop
    strings), and the forced start, marker and separator tokens to neither.

    Args:
        tokenizer: the model's tokenizer.
        stop: the request's stop strings (they apply to the answer only).
        end_text: the end marker's text.
    """

    def __init__(self, tokenizer, stop: list[str] | None, end_text: str):
        self.reasoning = IncrementalDetokenizer(tokenizer, [end_text])
        self.answer = IncrementalDetokenizer(tokenizer, stop)
        self.seen = 0  # output tokens routed so far

    def push(self, token_ids: list[int], matcher) -> tuple[str, str]:
        """Route the new output tokens; return the (answer, reasoning) text made final."""
        start = matcher.reasoning_start
        end, answer = matcher.reasoning_end, matcher.answer_start
        think: list[int] = []
        said: list[int] = []
        for i, t in enumerate(token_ids, self.seen):
            if answer is not None and i >= answer:
                said.append(t)
            elif start <= i and (end is None or i < end):
                think.append(t)
        self.seen += len(token_ids)
        r = self.reasoning.push(think) if think else ""
        if end is not None:
            r += self.reasoning.finish()  # the reasoning is over: release what it held back
        a = self.answer.push(said) if said else ""
        return a, r

    def finish(self) -> tuple[str, str]:
        """What is still held back: (answer, reasoning)."""
        return self.answer.finish(), self.reasoning.finish()

    @property
    def stopped(self) -> bool:
        """The answer met one of the request's stop strings."""
        return self.answer.stopped

    @property
    def text(self) -> str:
        """The answer's text once it began, else the reasoning's (what speculation reads)."""
        return self.answer.text if self.answer.tokens else self.reasoning.text
