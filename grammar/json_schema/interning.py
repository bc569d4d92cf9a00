"""Content numbers for schema values: equal JSON values get the same small int, in time linear in
the new parts of a value.

The compiler memoizes its work per sub-schema. Identity is not enough: an ``allOf`` of
references is merged anew wherever it is used, and every merge makes new dicts with equal
contents. Serializing a sub-schema to use it as a key costs its whole size at every use. Here
each value gets a number from its parts' numbers (hash-consing: Filliâtre and Conchon 2006,
"Type-safe modular hash-consing"): a dict is the tuple of its (key, value number) pairs in order
(property order is part of the meaning), a list the tuple of its items' numbers, a scalar its
type and value (``True`` and ``1`` differ). Numbers of objects seen before come from a table by
``id``, which keeps each object alive, so an id is never reused while the table lives.
"""

from __future__ import annotations


class ContentIds:
    """Numbers values by content for the life of one compilation (not thread-safe)."""

    __slots__ = ("_by_id", "_by_shape")

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[object, int]] = {}  # id(object) → (object, number)
        self._by_shape: dict[tuple, int] = {}  # shape (of numbers) → number

    def of(self, value: object) -> int:
        """The number of ``value`` (a JSON value: dict, list, str, int, float, bool, None)."""
        if isinstance(value, (dict, list)):
            hit = self._by_id.get(id(value))
            if hit is not None:
                return hit[1]
            if isinstance(value, dict):
                shape: tuple = ("d",) + tuple((k, self.of(v)) for k, v in value.items())
            else:
                shape = ("l",) + tuple(self.of(v) for v in value)
            n = self._number(shape)
            self._by_id[id(value)] = (value, n)
            return n
        return self._number((type(value).__name__, value))

    def _number(self, shape: tuple) -> int:
        n = self._by_shape.get(shape)
        if n is None:
            n = self._by_shape[shape] = len(self._by_shape)
        return n
