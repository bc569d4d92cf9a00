"""Local ``$ref`` resolution inside one schema document (never fetches anything).

Follows JSON Schema 2020-12 core §8.2 (``$id`` sets a base URI, ``$anchor`` / draft-04..07
fragment ids name a subschema) and RFC 6901 JSON pointers in the fragment. The identifier keyword
is the draft's own, as ``jsonschema`` reads it: ``id`` under draft-03/04, ``$id`` under draft-06
and later and when ``$schema`` is absent (2020-12); the other spelling is an unknown keyword. Any reference
whose target document is not the schema itself (or one of its embedded ``$id`` resources)
is "remote" and raises ``GrammarError`` with keyword ``$ref``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urldefrag, urljoin

from stencil.grammar.base import GrammarError

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SCHEMA_VALUES = ("additionalProperties", "additionalItems", "items", "not", "if", "then", "else",
                  "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


@dataclass(frozen=True, slots=True)
class Target:
    """A resolved reference: the subschema, its base URI and its JSON pointer (for errors)."""

    schema: object
    base: str
    pointer: str


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _ids_below(root: object, id_keyword: str) -> bool:
    """Whether some object below the root has a string ``id_keyword`` or ``$anchor`` (anywhere,
    also inside values: a false alarm only costs the full walk)."""
    stack = list(root.values()) if isinstance(root, dict) else []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get(id_keyword), str) or isinstance(node.get("$anchor"), str):
                return True
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return False


@dataclass(slots=True)
class RefResolver:
    """Index of the ``$id``s and anchors of one root schema."""

    root: object
    id_keyword: str = "$id"  # "id" for draft-03/04 roots, where "$id" is no keyword
    resources: dict[str, Target] = field(default_factory=dict)
    anchors: dict[tuple[str, str], Target] = field(default_factory=dict)
    bases: dict[int, str] = field(default_factory=dict)  # id(subschema) -> its base URI
    root_base: str = ""

    def __post_init__(self) -> None:
        if _ids_below(self.root, self.id_keyword):
            self._walk(self.root, "", "#")
        else:  # one base for every subschema: only the root needs indexing (most schemas)
            self._walk_node(self.root, "", "#")
        self.root_base = self.bases.get(id(self.root), "")

    def _walk_node(self, node: dict, base: str, pointer: str) -> str:
        """Index ``node``'s own ``$id`` and anchor; returns its base URI."""
        ident = node.get(self.id_keyword) if isinstance(node, dict) else None
        if isinstance(ident, str):
            if ident.startswith("#") and len(ident) > 1:
                self.anchors[(base, ident[1:])] = Target(node, base, pointer)
            else:
                base = urljoin(base, ident) if base else ident
                base = urldefrag(base)[0]
                self.resources[base] = Target(node, base, pointer)
        anchor = node.get("$anchor") if isinstance(node, dict) else None
        if isinstance(anchor, str):
            self.anchors[(base, anchor)] = Target(node, base, pointer)
        self.bases[id(node)] = base
        return base

    def _walk(self, node: object, base: str, pointer: str) -> None:
        if not isinstance(node, dict):
            return
        base = self._walk_node(node, base, pointer)
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                for name, value in sub.items():
                    self._walk(value, base, f"{pointer}/{key}/{_escape(name)}")
        for key in _SCHEMA_VALUES:
            if isinstance(node.get(key), dict):
                self._walk(node[key], base, f"{pointer}/{key}")
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, value in enumerate(node[key]):
                    self._walk(value, base, f"{pointer}/{key}/{i}")
        deps = node.get("dependencies")
        if isinstance(deps, dict):
            for name, value in deps.items():
                self._walk(value, base, f"{pointer}/dependencies/{_escape(name)}")

    def base_of(self, schema: object, default: str) -> str:
        return self.bases.get(id(schema), default)

    def resolve(self, ref: str, base: str, path: str) -> Target:
        """Resolve ``ref`` written in a schema whose base URI is ``base``.

        Raises:
            GrammarError: remote reference, or a pointer / anchor that does not exist.
        """
        full = urljoin(base, ref) if base else ref
        doc_uri, fragment = urldefrag(full)
        if doc_uri in ("", self.root_base) or doc_uri == urldefrag(self.root_base)[0]:
            doc = Target(self.root, self.root_base, "#")
        elif doc_uri in self.resources:
            doc = self.resources[doc_uri]
        else:
            raise GrammarError(f"remote reference {ref!r} is not fetched", keyword="$ref", path=path)
        if fragment == "":
            return doc
        if not fragment.startswith("/"):
            hit = self.anchors.get((doc.base, fragment))
            if hit is None:
                raise GrammarError(f"unknown anchor in {ref!r}", keyword="$ref", path=path)
            return hit
        node, pointer = doc.schema, doc.pointer
        for raw in fragment[1:].split("/"):
            token = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and token in node:
                node = node[token]
            elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
                node = node[int(token)]
            else:
                raise GrammarError(f"unresolvable reference {ref!r}", keyword="$ref", path=path)
            pointer = f"{pointer}/{_escape(token)}"
        return Target(node, self.base_of(node, doc.base), pointer)
