"""Regexes (over decoded strings) for JSON Schema ``format`` values.

Each regex admits only strings that ``jsonschema``'s ``Draft202012Validator.FORMAT_CHECKER``
accepts (jsonschema 4.x with its format extras installed), usually a canonical subset:

- date: ``date.fromisoformat`` on ``YYYY-MM-DD`` (year ≥ 1, real day of month, leap years).
- time / date-time: RFC 3339 §5.6 as ``rfc3339_validator`` checks it (upper-case ``T``/``Z``).
- email / idn-email: the checker wants an ``@``; we admit ``dot-atom@host.name`` (ASCII).
- uuid: ``uuid.UUID`` with hyphens at 8, 13, 18, 23 (RFC 4122 textual form).
- ipv4: ``ipaddress.IPv4Address`` (dotted quad, no leading zeros).
- ipv6: ``ipaddress.IPv6Address`` without zone or embedded IPv4 (RFC 4291 §2.2 forms 1-2).
- hostname: ``fqdn.FQDN(min_labels=1)`` (RFC 1123 labels ≤ 63, at most 4 labels so the total
  stays under 253 characters, never ``--`` at a label's third and fourth characters: no fake A-labels).
- uri / uri-reference / iri / iri-reference: RFC 3986 §3 ``scheme ":" hier-part`` with
  registered-name hosts (and relative references for the ``-reference`` kinds).
- json-pointer: RFC 6901.
- regex: a regular subset of the patterns ``re.compile`` accepts (the checker's test), in syntax
  ECMA-262 reads too: literals, escapes of a class (``\\d``, ``\\w``, ``\\s`` and their negations) or
  of punctuation, ``.``, character classes whose ranges start at the first letter or digit or end
  at the last (``[a-fA-Z0-9_]``, ``[x-z1-9]``), groups ``(...)`` / ``(?:...)`` nested at most two
  deep, alternation, the quantifiers ``* + ?``, ``{n}``, ``{n,}`` and ``{n,m}`` (at most three
  digits, n ≤ m shown by form: n 0 or 1, or of fewer digits than m) with an optional lazy ``?``,
  and the unquantified anchors ``^ $ \\b \\B``. No named groups, lookaround or backreferences.
  Kept small, since its automaton is part of every mask computed inside such a string.

Formats that the checker does not know are annotations and constrain nothing (``None`` from
``format_pattern`` means "unconstrained"); formats it knows but we do not cover raise
``KeyError`` so the caller can fail closed.
"""

from __future__ import annotations

_D = "[0-9]"
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = ("(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
              "|(?:0[13-9]|1[0-2])-(?:29|30)"
              "|(?:0[13578]|1[02])-31)")
DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME_CORE = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
_OFFSET = "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
TIME = _TIME_CORE + _OFFSET
DATE_TIME = f"{DATE}T{TIME}"
_HEX = "[0-9a-fA-F]"
UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"
_H16 = f"{_HEX}{{1,4}}"


def _ipv6() -> str:
    forms = [f"(?:{_H16}:){{7}}{_H16}"]
    # "::" standing for one or more zero groups: i groups before it, j after, i + j <= 7.
    for before in range(0, 8):
        for after in range(0, 8 - before):
            head = "" if before == 0 else f"{_H16}(?::{_H16}){{{before - 1}}}"
            tail = "" if after == 0 else f"{_H16}(?::{_H16}){{{after - 1}}}"
            forms.append(f"{head}::{tail}")
    return "(?:" + "|".join(forms) + ")"


IPV6 = _ipv6()
_A = "[a-zA-Z0-9]"
_AH = "[a-zA-Z0-9-]"
# RFC 1123 label, 1-63 characters, never "--" at the third and fourth characters: such a label
# would claim to be an IDNA A-label ("xn--"), which the JSON-Schema-Test-Suite requires to be
# valid punycode (RFC 5891 §4.2.3.1).
_LABEL = (f"(?:{_A}(?:{_AH}?{_A})?|{_A}{_AH}(?:{_A}|-){_A}"
          f"|{_A}{_AH}(?:{_A}{_AH}|-{_A}){_AH}{{0,58}}{_A})")
HOSTNAME = f"{_LABEL}(?:\\.{_LABEL}){{0,3}}"
# RFC 5321 dot-atom local part (no leading, trailing or doubled dots) @ hostname with a dot.
# Atoms are at most 64 characters (RFC 5321 §4.5.3.1.1 caps the whole local part there): a subset
# of valid addresses that also stops a model looping inside the local part until max_tokens.
_ATOM = "[a-zA-Z0-9_%+-]{1,64}"
EMAIL = f"{_ATOM}(?:\\.{_ATOM}){{0,3}}@{_LABEL}(?:\\.{_LABEL}){{1,3}}"
_UNRESERVED = "a-zA-Z0-9._~\\-"
_SUB_DELIMS = "!$&'()*+,;="
_PCT = f"%{_HEX}{{2}}"
_PCHAR = f"(?:[{_UNRESERVED}{_SUB_DELIMS}:@]|{_PCT})"
_SCHEME = "[a-zA-Z][a-zA-Z0-9+.\\-]*"
_REG_NAME = f"(?:[{_UNRESERVED}{_SUB_DELIMS}]|{_PCT})*"
_USERINFO = f"(?:(?:[{_UNRESERVED}{_SUB_DELIMS}:]|{_PCT})*@)?"
_AUTHORITY = f"{_USERINFO}{_REG_NAME}(?::[0-9]*)?"
_SEGMENT = f"{_PCHAR}*"
_SEGMENT_NZ = f"{_PCHAR}+"
_QUERY_FRAG = f"(?:\\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_HIER = (f"(?://{_AUTHORITY}(?:/{_SEGMENT})*|/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"
         f"|{_SEGMENT_NZ}(?:/{_SEGMENT})*|)")
URI = f"{_SCHEME}:{_HIER}{_QUERY_FRAG}"
_SEGMENT_NZ_NC = f"(?:[{_UNRESERVED}{_SUB_DELIMS}@]|{_PCT})+"
_RELATIVE = (f"(?://{_AUTHORITY}(?:/{_SEGMENT})*|/(?:{_SEGMENT_NZ}(?:/{_SEGMENT})*)?"
             f"|{_SEGMENT_NZ_NC}(?:/{_SEGMENT})*|){_QUERY_FRAG}")
URI_REFERENCE = f"(?:{URI}|{_RELATIVE})"
JSON_POINTER = "(?:/(?:[^~/]|~[01])*)*"


def _regex_format(depth: int = 2) -> str:
    lit = "[^\\\\^$.|?*+()\\[\\]{}]"
    esc = "\\\\(?:[dDwWsSntrfv]|[\\\\^$.|?*+()\\[\\]{}/-])"
    # Ordered ranges without enumerating pairs: from the first symbol of a run ("a-f", "0-7")
    # or to its last ("x-z", "1-9").
    ranges = "a-[a-z]|[a-z]-z|A-[A-Z]|[A-Z]-Z|0-[0-9]|1-[1-9]|[0-9]-9"
    item = f"(?:[^\\\\\\[\\]^-]|{esc}|{ranges})"  # "^" only escaped: "[^]" is no class
    cls = f"\\[\\^?(?:-|-?{item}*(?:{item}|-))\\]"
    # {n}, {n,}, and {n,m} with n <= m: n of one digit and m of two or three, n of two and
    # m of three, n = 0, or n = 1 and m >= 1.
    bounded = "[0-9],[1-9][0-9]{1,2}|[1-9][0-9],[1-9][0-9]{2}|0,[0-9]{1,3}|1,[1-9][0-9]{0,2}"
    quant = f"(?:(?:[*+?]|\\{{(?:[0-9]{{1,3}},?|{bounded})\\}})\\??)"
    anchor = "[$^]|\\\\[bB]"
    # A sequence of quantified atoms, anchors and bars: "a||b", "|a" and "" all compile, so the
    # alternation needs no structure of its own and the text grows linearly with the depth.
    body = ""
    for _ in range(depth + 1):
        group = f"|\\((?:\\?:)?{body}\\)" if body else ""
        atom = f"(?:{lit}|{esc}|\\.|{cls}{group})"
        body = f"(?:{atom}{quant}?|{anchor}|\\|)*"
    return body

_PATTERNS = {
    "date": DATE, "time": TIME, "date-time": DATE_TIME, "uuid": UUID, "ipv4": IPV4,
    "ipv6": IPV6, "hostname": HOSTNAME, "email": EMAIL, "idn-email": EMAIL, "uri": URI,
    "iri": URI, "uri-reference": URI_REFERENCE, "iri-reference": URI_REFERENCE,
    "json-pointer": JSON_POINTER, "regex": _regex_format(),
}
# Known to jsonschema's 2020-12 format checker but not covered here: fail closed.
_CHECKED_UNSUPPORTED = {"duration", "idn-hostname", "relative-json-pointer",
                        "uri-template"}


def format_pattern(name: str) -> str | None:
    """Anchored-by-convention regex (decoded level) for format ``name``.

    Returns None for formats the checker ignores (pure annotations). Raises ``KeyError`` for
    formats the checker enforces that we do not cover.
    """
    if name in _PATTERNS:
        return _PATTERNS[name]
    if name in _CHECKED_UNSUPPORTED:
        raise KeyError(name)
    return None
