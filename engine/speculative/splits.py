"""Tokenization lessons for drafts of grammar-forced text (``TokenSplits``)."""

from __future__ import annotations


class TokenSplits:
    """How the model spells grammar-forced text, learned from what it chose over the drafts.

    The canonical tokenization of forced text is not always the model's: in one output SmolLM2
    writes ``":"`` as ``":`` then ``"`` (its strings open with a lone quote), in another as one
    token. Three lessons are kept, per request (its output keeps one style) with the engine's
    table behind it for requests that have not shown theirs yet:

    - a draft ``d`` rejected for ``t`` whose text is a proper prefix of ``d``'s: spell ``d`` as
      ``t`` plus the tokenization of the rest;
    - a draft rejected for a token whose text extends it: the model writes that token whole;
    - the last token of forced text, left out of the drafts because it may merge with the free
      text after it, that the model then wrote exactly: draft it next time.

    Never a correctness matter (every draft is verified); bounded (oldest entries dropped).

    Args:
        decode: token ids -> text (the tokenizer's ``decode``).
        encode: text -> token ids, no special tokens.
        parent: the engine-wide table consulted for tokens this one has no lesson on.
        max_entries: most lessons kept per table.
    """

    def __init__(self, decode, encode, parent: "TokenSplits | None" = None, max_entries: int = 1024) -> None:
        self._decode = decode
        self._encode = encode
        self._parent = parent
        self._max = max_entries
        self.spelling: dict[int, tuple[int, ...]] = {}  # token -> the model's pieces (itself: whole)
        self.ends: dict[int, bool] = {}  # token -> whether the model writes it alone before free text

    def child(self) -> "TokenSplits":
        """A per-request table backed by this one."""
        return TokenSplits(self._decode, self._encode, self, self._max)

    def learn(self, draft: int, chosen: int, dropped: bool = False) -> None:
        """Record that the model chose ``chosen`` where ``draft`` was proposed (or, with
        ``dropped``, where ``draft`` was the forced text's last token, left out)."""
        for table in (self, self._parent):
            if table is not None:
                table._learn(draft, chosen, dropped)

    def _learn(self, draft: int, chosen: int, dropped: bool) -> None:
        if draft == chosen:
            if dropped:
                self._put(self.ends, draft, True)
            return
        d, c = self._decode([draft]), self._decode([chosen])
        if c and len(c) < len(d) and d.startswith(c):
            self._put(self.spelling, draft, (chosen, *self._encode(d[len(c):])))
        elif d and len(d) < len(c) and c.startswith(d):
            self._put(self.spelling, chosen, (chosen,))
            self._put(self.ends, draft, False)

    def _put(self, table: dict, key: int, value) -> None:
        table.pop(key, None)
        if len(table) >= self._max:
            table.pop(next(iter(table)))
        table[key] = value

    def _lookup(self, name: str, key: int):
        table = self
        while table is not None:
            found = getattr(table, name).get(key)
            if found is not None:
                return found
            table = table._parent
        return None

    def tokenize(self, text: str) -> tuple[list[int], bool]:
        """``text`` as the model would likely write it; also whether its last token is one the
        model writes on its own (a learned split's last piece, or a learned end)."""
        out: list[int] = []
        split = False
        for t in self._encode(text):
            pieces = self._lookup("spelling", t) or (t,)
            split = len(pieces) > 1
            out.extend(pieces)
        return out, bool(out) and (split or bool(self._lookup("ends", out[-1])))
