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
