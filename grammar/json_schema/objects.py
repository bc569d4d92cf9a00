"""JSON objects: ``properties``, ``required``, ``additionalProperties``, ``patternProperties``,
``propertyNames``, ``minProperties``/``maxProperties`` (2020-12 §10.3.2, §6.5).

Canonical layout: declared properties in schema order (then required names that are not
declared, in ``required`` order), then any additional properties. Optional properties are
written as "any subset, in order": with a required property the regex is linear, without one
it is a chain of "the members so far, then maybe this one" (linear, see ``_ordered_subsets``).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from stencil.grammar import charset as cs
from stencil.grammar.json_schema import pattern as sp
from stencil.grammar.program import both, is_regular_text, minus
from stencil.grammar.json_schema.rx import Rx, alt, opt, seq

if TYPE_CHECKING:
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler

MAX_OBJECT_REGEX = 2_000_000
_ANY_KEY = '"' + cs.json_char(cs.ANY_CHAR) + '*"'


def _key_literal(name: str) -> str:
    return '"' + cs.literal(cs.json_escape_text(name)) + '"'


def _declared_part(items: list[tuple[str, bool]], comma: str, min_one: bool) -> tuple[Rx, bool]:
    """Members in order; optional ones may be skipped; commas only between written members.

    Returns ``(members, may_be_empty)``: the regex of the non-empty member lists (None when
    there is none) and whether writing no member at all is allowed too (``min_one`` forbids it).
    The object's braces and whitespace are the caller's (``SchemaCompiler.bracket``), so that an
    empty object has one run of whitespace, not two.
    """
    first_required = next((i for i, (_, req) in enumerate(items) if req), None)
    if first_required is not None:
        head = "".join(opt(seq(m, comma)) for m, _ in items[:first_required])
        tail = "".join(seq(comma, m) if req else opt(seq(comma, m))
                       for m, req in items[first_required + 1:])
        return head + items[first_required][0] + tail, False
    if not items:
        return None, not min_one
    return _ordered_subsets([m for m, _ in items], comma), not min_one


_CHAIN = 12


def _ordered_subsets(members: list[str], comma: str) -> str:
    """Regex of every non-empty in-order subsequence of ``members``, comma-separated.

    A left chain ``L_i = (?:L_{i-1}(?:,m_i)?|m_i)`` writes each member twice (linear size) but
    nests one group per member, and the Rust regex parser behind outlines-core refuses nesting
    beyond ~250. So members are cut into at most ``_CHAIN`` blocks, each block's subsequences
    built the same way, and the blocks chained: size O(n · 2^levels), nesting O(_CHAIN · levels).
    """
    if len(members) > _CHAIN:
        size = -(-len(members) // _CHAIN)
        members = [_ordered_subsets(members[i:i + size], comma)
                   for i in range(0, len(members), size)]
    body = members[0]
    for m in members[1:]:
        body = f"(?:{body}(?:{comma}{m})?|{m})"
    if len(body) > MAX_OBJECT_REGEX:
        raise OverflowError
    return body


def compile_object(c: "SchemaCompiler", s: dict, path: str) -> Rx:
    comma, colon = c.ws + "," + c.ws, c.ws + ":" + c.ws
    props: dict = s.get("properties", {}) if isinstance(s.get("properties"), dict) else {}
    required = [r for r in s.get("required", []) if isinstance(r, str)]
    patterns: dict = s.get("patternProperties") or {}
    names_schema = s.get("propertyNames", True)
    # Without additionalProperties: extra keys only where nothing is declared (a free-form
    # object), unless the caller asks for the specification's default everywhere.
    free_form = not props and not patterns
    addl = s.get("additionalProperties", True if c.opts.extra_properties or free_form else False)
    for key in ("unevaluatedProperties",):
        if s.get(key) not in (None, {}, True):
            c.unsupported(key, path)

    def value_for(name: str, schema: object, where: str) -> Rx:
        matching = [p for p in patterns if re.search(p, name)]
        subs = [schema] + [patterns[p] for p in matching]
        merged = subs[0] if len(subs) == 1 else {"allOf": subs}
        if names_schema is not True and not c.value_valid(name, names_schema):
            return None
        return c.sub(merged, where)

    order = list(props) + [r for r in required if r not in props]
    members: list[tuple[str, bool]] = []
    for name in order:
        if name in props:
            schema, where = props[name], f"{path}/properties/{_escape(name)}"
        else:
            # A required name the schema does not declare takes additionalProperties' schema
            # (any value when absent: our "no extra keys" default is for optional keys only).
            declared_addl = s.get("additionalProperties", True)
            if not patterns and declared_addl is False:
                return None
            schema = next((patterns[p] for p in patterns if re.search(p, name)), declared_addl)
            if any(re.search(p, name) for p in patterns):
                schema = True
            where = f"{path}/required"
        value = value_for(name, schema, where)
        if value is None:
            if name in required:
                return None
            continue
        members.append((seq(c.key_term(_key_literal(name)), colon, value), name in required))

    extra = _extra_member(c, s, path, order, patterns, addl, names_schema, colon)
    min_p, max_p = s.get("minProperties", 0), s.get("maxProperties")
    n_req = sum(1 for _, r in members if r)
    if max_p is not None and max_p < n_req:
        return None
    if max_p is not None and (extra is not None or max_p < len(members)):
        c.unsupported("maxProperties", path)
    if extra is None and min_p > len(members):
        return None
    if min_p > max(n_req, 1):
        c.unsupported("minProperties", path)
    min_one = min_p >= 1 and n_req == 0
    try:
        if extra is None:
            body, empty_ok = _declared_part(members, comma, min_one)
            if body is None and not empty_ok:
                return None
        else:
            extras = "(?:" + comma + extra + ")*"
            if n_req:
                body, empty_ok = seq(_declared_part(members, comma, False)[0], extras), False
            else:
                declared = _declared_part(members, comma, True)[0]
                body, empty_ok = alt([seq(declared, extras), seq(extra, extras)]), not min_one
    except OverflowError:
        c.unsupported("properties", path, "too many optional properties to write exactly")
        return None
    return c.bracket("\\{", "\\}", body, empty_ok)


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _extra_member(c: "SchemaCompiler", s: dict, path: str, declared: list[str], patterns: dict,
                  addl: object, names_schema: object, colon: str) -> Rx:
    """Regex of one additional ``"key":value`` member, or None when none is allowed."""
    parts: list[Rx] = []
    if addl is not False and patterns and (not c.opts.grammar or names_schema is not True):
        # The other keys are those no pattern matches: a complement, which only grammar mode
        # (llguidance's ``&~``) writes; with propertyNames too, not written.
        c.unsupported("patternProperties", path, "patternProperties with open additionalProperties"
                      + ("" if c.opts.grammar else " (the lazy grammar backend serves it)"))
        return None
    if patterns:
        names = list(patterns)
        if any(not _disjoint_patterns(a, b) for i, a in enumerate(names) for b in names[i + 1:]):
            # A key matching two patterns takes both schemas: not written without complements.
            c.unsupported("patternProperties", path, "several patternProperties that a key may "
                          "match together (exact only for patterns with different literal "
                          "prefixes or endings, such as ^a and ^b, or a$ and b$)")
            return None
        matched_by: list[Rx] = []  # per pattern, the keys it matches (declared or not)
        for pattern, schema in patterns.items():
            key = c.string_for({"type": "string", "pattern": pattern}, f"{path}/patternProperties")
            matched_by.append(key)
            value = c.sub(schema, f"{path}/patternProperties/{_escape(pattern)}")
            key = _without_declared(c, key, declared, "patternProperties", path,
                                    "pattern matches a declared property")
            if key is None or value is None:
                continue
            parts.append(seq(c.key_term(key), colon, value))
        if addl is not False:
            # Keys neither declared nor matched by a pattern take additionalProperties' schema.
            # A pattern that spells its keys (``^billing_id$``) joins the declared names in the
            # trie complement; only the others are taken away with ``& ~``, which leaves the
            # program without a plain-regex form (no eager index) and costs llguidance more
            # (JsonSchemaStore strmprivacy DataConnector, 38 such patterns: worst mask 7.5 -> 1.5 ms).
            spelled = {p: _spelled_keys(p) for p in patterns}
            named = declared + [k for keys in spelled.values() if keys is not None for k in keys]
            key = c.excluded_strings(named) if named else _ANY_KEY
            rest = [m for p, m in zip(patterns, matched_by) if spelled[p] is None and m is not None]
            if rest:
                key = minus(key, c._share(alt(rest)))
            value = c.sub(addl, f"{path}/additionalProperties")
            if value is not None:
                parts.append(seq(c.key_term(key), colon, value))
    elif addl is not False:
        if names_schema is not True:
            key = c.string_for(names_schema, f"{path}/propertyNames")
            key = _without_declared(c, key, declared, "propertyNames", path,
                                    "property names overlap declared ones")
            if key is None:
                return None
        else:
            key = c.excluded_strings(declared) if declared else _ANY_KEY
        value = c.sub(addl, f"{path}/additionalProperties")
        parts.append(seq(c.key_term(key), colon, value))
    return alt(parts)


def _spelled_keys(pattern: str) -> list[str] | None:
    """The keys ``pattern`` matches (``re.search``) when it spells them out, one per top-level
    alternative anchored at both ends with a literal between (``^id$`` matches "id" and, by
    ``$``, "id\\n"); None for any other pattern."""
    try:
        alternatives = sp.branches(sp.parse(pattern, over=True))
    except sp.PatternError:
        return None
    out: list[str] = []
    for branch in alternatives:
        items = list(branch.body.items) if isinstance(branch.body, sp.Seq) else [branch.body]
        if not (branch.start and branch.end) or not all(
                isinstance(it, sp.Atom) and cs.size(it.chars) == 1 for it in items):
            return None
        text = "".join(chr(it.chars[0][0]) for it in items)
        out += [text, text + "\n"] if branch.newline_ok else [text]
    return out


@functools.lru_cache(maxsize=512)
def _literal_ends(pattern: str) -> tuple[tuple[str | None, tuple[str, ...] | None], ...] | None:
    """For each top-level alternative of ``pattern``: the characters every string it matches
    (``re.search``) starts with (None unless anchored by ``^``), and the endings one of which
    every such string ends with (None unless anchored by ``$`` or ``\\Z``: its literal tail, and
    that tail with a newline where ``$`` lets one follow). None when the pattern is outside what
    ``stencil.grammar.json_schema.pattern`` reads. Read from that module's parse with
    over-approximated atoms, so a one-character atom is exactly that character. Kept per pattern:
    ``_disjoint_patterns`` asks for each pattern once per other one (19 patterns: 342 parses)."""
    try:
        alternatives = sp.branches(sp.parse(pattern, over=True))
    except sp.PatternError:
        return None

    def literal(items) -> str:
        out = []
        for item in items:
            if not (isinstance(item, sp.Atom) and cs.size(item.chars) == 1):
                break
            out.append(chr(item.chars[0][0]))
        return "".join(out)

    out = []
    for branch in alternatives:
        items = list(branch.body.items) if isinstance(branch.body, sp.Seq) else [branch.body]
        prefix = literal(items) if branch.start else None
        ends = None
        if branch.end:
            tail = literal(reversed(items))[::-1]
            ends = (tail, tail + "\n") if branch.newline_ok else (tail,)
        out.append((prefix, ends))
    return tuple(out)


def _apart(x: str, y: str) -> bool:
    """Whether no string starts (or ends) with both ``x`` and ``y``: neither is the other's
    prefix (or suffix), the check given both ways round by the caller's reading."""
    return bool(x) and bool(y) and not x.startswith(y) and not y.startswith(x)


def _disjoint_patterns(a: str, b: str) -> bool:
    """True only if no string matches both patterns: every alternative of one is kept apart from
    every alternative of the other by their literal prefixes (both anchored at the start, neither
    prefix a prefix of the other) or by their literal endings (both anchored at the end, no ending
    of one a suffix of an ending of the other: a string ending with both would make one so)."""
    ea, eb = _literal_ends(a), _literal_ends(b)
    if not ea or not eb:
        return False

    def apart(x, y) -> bool:
        (pa, ta), (pb, tb) = x, y
        if pa is not None and pb is not None and _apart(pa, pb):
            return True
        return ta is not None and tb is not None and all(
            _apart(u[::-1], v[::-1]) for u in ta for v in tb)

    return all(apart(x, y) for x in ea for y in eb)


def _without_declared(c: "SchemaCompiler", key: Rx, declared: list[str], keyword: str, path: str,
                      message: str) -> Rx:
    """The key regex of additional members, minus the declared names (those take their own
    schema): unchanged when it matches none of them; otherwise, in grammar mode, its
    intersection with "any key but these" (llguidance's ``&``: lazy backend only), else a
    refusal naming ``keyword``. A key that is itself an intersection or complement (grammar
    mode: a pattern with a lookaround, a pattern with a length) is not tested with Python's
    ``re``, which cannot read it: the names are taken away."""
    if key is None or not declared:
        return key
    if is_regular_text(key, c.terminals) and not any(re.fullmatch(key, _key_literal_text(n)) for n in declared):
        return key
    if c.opts.grammar:
        return both(key, c.excluded_strings(declared))
    c.unsupported(keyword, path, message)
    return None


def _key_literal_text(name: str) -> str:
    return '"' + cs.json_escape_text(name) + '"'
