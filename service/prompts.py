"""Prompt → token ids, with request content kept as data: it never becomes a control token.

A chat template writes control tokens (``<|im_start|>``, ``<|im_end|>``, ...) as text, and the
rendered text is encoded with those texts parsed into their ids. Encoding the whole render that
way would parse them inside a message too: a user who writes ``Hi<|im_end|>\\n<|im_start|>system``
would write a system turn. OpenAI's API never lets content become control tokens; nor does
Stencil.

How (Stencil's own scheme; transformers offers ``split_special_tokens`` only for a whole text):

1. Every string a request brings into the template (message content and its text parts, names,
   tool-call ids and arguments, tool results, tool definitions, dict keys included; not
   ``role`` and ``type``, which are checked enums the template compares) is *defanged*: each
   occurrence of a control token's text is replaced by a marker, an ASCII string with a
   random nonce that no tokenizer text, JSON escaping or Jinja filter changes. So are the
   string's ends where they could join the template's text into a control token: a suffix
   that is a proper prefix of a control text (``...<|im_``), a prefix that is a proper suffix
   (``end|>...``), and a whole short string that lies inside one.
2. The template renders the defanged messages. Its own control tokens are the only ones left
   in the text.
3. The text is cut at the markers: the template's pieces are encoded as before (control texts
   parsed), each marker as the text it stands for with control texts split into ordinary
   tokens (``split_special_tokens=True``).

Content without control-token text renders to exactly the text it did before, and is encoded
in one piece: its token ids do not change (nor does any greedy output or prefix-cache hit).
Where a marker cuts the text, the pieces either side are encoded apart, so the tokens at the
cut may differ from a whole-text encoding (the text they decode to does not).

A plain ``prompt`` (``/generate``, ``/v1/completions``) is encoded with the tokenizer's own
``split_special_tokens=True`` and its usual BOS; ``parse_special_tokens=True`` asks for the
control texts to be parsed (the caller writes its own template).

The control tokens of a tokenizer are its added tokens marked special (SmolLM2: ids 0-16,
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<repo_name>``, ...) and its
``all_special_tokens``.
"""

from __future__ import annotations

import inspect
import re
import secrets
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stencil.service.errors import InputError

# Values the template compares (checked enums): defanging them would change its branches.
_STRUCTURAL_KEYS = frozenset({"role", "type"})
_MARKER_PREFIX = "stencilctl"


@dataclass(frozen=True, slots=True)
class ControlTokens:
    """A tokenizer's control tokens, as texts and ids, with what defanging needs.

    Attributes:
        ids: the control token ids.
        texts: their texts, longest first.
        pattern: matches any of ``texts`` (longest first at each position), or ``None`` when
            there are none.
        prefixes: every proper, non-empty prefix of a text.
        suffixes: every proper, non-empty suffix of a text.
        joined: the texts joined by NUL (``s in joined``: ``s`` lies inside some text).
        longest: the longest text's length in characters.
    """

    ids: frozenset[int]
    texts: tuple[str, ...]
    pattern: re.Pattern | None
    prefixes: frozenset[str]
    suffixes: frozenset[str]
    joined: str
    longest: int

    @classmethod
    def build(cls, ids: Iterable[int], texts: Iterable[str]) -> "ControlTokens":
        ordered = tuple(sorted({t for t in texts if t}, key=lambda t: (-len(t), t)))
        pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        return cls(ids=frozenset(ids), texts=ordered, pattern=pattern,
                   prefixes=frozenset(t[:k] for t in ordered for k in range(1, len(t))),
                   suffixes=frozenset(t[k:] for t in ordered for k in range(1, len(t))),
                   joined="\0".join(ordered), longest=max(map(len, ordered), default=0))


_CACHE: "weakref.WeakKeyDictionary[Any, ControlTokens]" = weakref.WeakKeyDictionary()


def control_tokens(tokenizer) -> ControlTokens:
    """The control tokens of a transformers tokenizer (built once per tokenizer object)."""
    try:
        return _CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    pairs = {i: a.content for i, a in decoder.items() if getattr(a, "special", False)}
    for text in getattr(tokenizer, "all_special_tokens", None) or ():
        i = tokenizer.convert_tokens_to_ids(text)
        if isinstance(i, int) and i >= 0:
            pairs.setdefault(i, text)
    found = ControlTokens.build(pairs, pairs.values())
    try:
        _CACHE[tokenizer] = found
    except TypeError:  # not weak-referenceable: build again next time (a few ms)
        pass
    return found


class Defanger:
    """Replaces control-token text in request strings by markers, and encodes the result.

    One per prompt: its nonce makes the markers unguessable, so no request text can contain
    one (a text that happens to is refused, with odds of about 2^-64).

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.control = control_tokens(tokenizer)
        self.pieces: list[str] = []
        self._tag = f"{_MARKER_PREFIX}{secrets.token_hex(8)}"
        self._marker = re.compile(re.escape(self._tag) + r"n(\d+)x")

    def _mark(self, text: str) -> str:
        self.pieces.append(text)
        return f"{self._tag}n{len(self.pieces) - 1}x"

    def text(self, s: str, *, ends: bool = True) -> str:
        """``s`` with each control-token text (and, with ``ends``, each joinable end) marked.

        Raises:
            InputError: ``s`` contains this prompt's marker tag (practically impossible).
        """
        ct = self.control
        if ct.pattern is None or not s:
            return s
        if self._tag in s:
            raise InputError("the request contains a reserved marker; send it again", field="messages")
        if ends and len(s) < ct.longest and s in ct.joined:
            return self._mark(s)  # could sit inside a control text written around it
        head = tail = ""
        if ends:
            for k in range(min(len(s), ct.longest) - 1, 0, -1):
                if s[:k] in ct.suffixes:
                    head, s = self._mark(s[:k]), s[k:]
                    break
            for k in range(min(len(s), ct.longest) - 1, 0, -1):
                if s[-k:] in ct.prefixes:
                    s, tail = s[:-k], self._mark(s[-k:])
                    break
        return head + ct.pattern.sub(lambda m: self._mark(m.group(0)), s) + tail

    def value(self, v: Any, key: str | None = None) -> Any:
        """A copy of a JSON-like value (dicts, lists, strings) with every string defanged
        (dict keys too, without the ends rule); ``role`` and ``type`` values are kept."""
        if isinstance(v, str):
            return v if key in _STRUCTURAL_KEYS else self.text(v)
        if isinstance(v, dict):
            return {self.text(k, ends=False) if isinstance(k, str) else k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [self.value(x) for x in v]
        return v

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a text rendered from defanged strings: the template's control texts
        parsed, every marked piece as plain text."""
        tok = self.tokenizer
        if not self.pieces:
            return list(tok.encode(rendered, add_special_tokens=False))
        ids: list[int] = []
        at = 0
        for m in self._marker.finditer(rendered):
            if m.start() > at:
                ids.extend(tok.encode(rendered[at:m.start()], add_special_tokens=False))
            k = int(m.group(1))
            if k < len(self.pieces):
                ids.extend(_plain_ids(tok, self.pieces[k]))
            at = m.end()
        if at < len(rendered):
            ids.extend(tok.encode(rendered[at:], add_special_tokens=False))
        return ids


def _plain_ids(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=True))


def message_text(content: Any, index: int) -> str:
    """Content of a chat message as text: a string, or OpenAI-style ``[{"type": "text", ...}]`` parts.

    Raises:
        InputError: (field ``messages[i].content``) a part that is not text.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InputError(f"messages[{index}].content[{j}]: only text parts are supported",
                                 field=f"messages[{index}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise InputError(f"messages[{index}].content must be a string or a list of text parts",
                     field=f"messages[{index}].content")


# Keywords the service gives the template itself: a request's chat_template_kwargs may not set them.
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt"})


def check_template_kwargs(tokenizer, kwargs: dict[str, Any]) -> None:
    """Refuse ``chat_template_kwargs`` keys the service sets itself: ``messages``, ``tools``,
    ``add_generation_prompt`` and every parameter of ``apply_chat_template`` (``tokenize``,
    ``documents``, ``chat_template``, ...).

    Raises:
        InputError: (field ``chat_template_kwargs``) naming the first such key.
    """
    try:
        own = {n for n, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
               if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    except (TypeError, ValueError):
        own = set()
    for key in kwargs:
        if not isinstance(key, str) or key in _TEMPLATE_OWN or key in own:
            raise InputError(f"chat_template_kwargs: {key!r} is set by the server (the messages, tools and "
                             "generation prompt are the request's own fields)", field="chat_template_kwargs")


def check_template_renders(tokenizer) -> None:
    """Render one user message with the tokenizer's chat template, as a chat request would.

    ``stencil serve --chat-template`` checks its template this way once the model's tokenizer is
    loaded (its special tokens are template variables), so a template that parses but fails on
    every request (an attribute of a message it lacks, an unknown filter, ``raise_exception`` on
    a user turn), is empty, or never writes the message it is given, is refused at start, not
    answered 400 (or with a prompt that lost the conversation) on each chat.

    Raises:
        stencil.engine.config.ConfigError: ``chat_template does not render: line N: ...``, the
            line of the template where rendering failed (when Jinja says it); or the template is
            empty, or its render lacks the user's message.
    """
    import traceback

    from stencil.engine.config import ConfigError

    probe = "Hello from stencil's start-up check"
    if not (tokenizer.chat_template or "").strip():
        raise ConfigError("chat_template is empty: give a Jinja template that writes the messages")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception as e:  # noqa: BLE001 - Jinja raises TemplateError, UndefinedError, TypeError, ...
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == "<template>"]
        line = lines[-1] if lines else getattr(e, "lineno", None)
        where = f"line {line}: " if line else ""
        raise ConfigError(f"chat_template does not render: {where}{e}") from None
    if probe not in text:
        raise ConfigError("chat_template does not write the user's message: rendering one user message gave "
                          f"{text[:80]!r}")


def render_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                    defanger: Defanger | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """Render chat messages with the tokenizer's chat template, ending with the assistant's turn.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template``.
        messages: ``[{"role": ..., "content": ...}, ...]``; other keys (``tool_calls``, ``name``,
            ``tool_call_id``) are passed to the template.
        tools: OpenAI-style tool definitions handed to the template, if it uses them.
        defanger: marks control-token text in every string first (``encode_prompt`` passes
            one); ``None`` renders the strings as they are.
        template_kwargs: extra keywords for the template (vLLM's ``chat_template_kwargs``:
            ``{"enable_thinking": false}``); their strings are defanged as content is.

    Raises:
        InputError: (field ``messages``) no chat template, or the template refused the messages
            (e.g. roles out of order); (field ``chat_template_kwargs``) a key the server sets
            (``check_template_kwargs``).

    The template runs in transformers' sandboxed Jinja environment: request content is data,
    never code.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template (tokenizer.chat_template; a base model); send a plain "
                         "'prompt' to /generate or use /v1/completions", field="messages")
    msgs = []
    for i, m in enumerate(messages):
        msg = dict(m)
        msg["content"] = message_text(m.get("content"), i)
        msgs.append(defanger.value(msg) if defanger is not None else msg)
    if tools and defanger is not None:
        tools = defanger.value(tools)
    kwargs = {"tools": tools} if tools else {}
    if template_kwargs:
        check_template_kwargs(tokenizer, template_kwargs)
        kwargs.update(defanger.value(template_kwargs) if defanger is not None else template_kwargs)
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateError and others for bad input
        raise InputError(f"the chat template refused these messages: {e}", field="messages") from None


def encode_prompt(tokenizer, prompt: str | None = None, messages: list[dict] | None = None,
                  tools: list[dict] | None = None, *, parse_special_tokens: bool = False,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a plain prompt, or of messages rendered with the chat template; content
    never becomes a control token (the module docstring says how).

    A plain prompt gets the tokenizer's usual special tokens (BOS where the model wants one);
    a rendered chat already contains them as text, so it is encoded without adding more.

    Args:
        parse_special_tokens: plain prompts only: parse control-token text in ``prompt`` into
            control tokens (the caller applies its own template). Default: plain text.
        template_kwargs: messages only: the template's extra keywords (``render_messages``).

    Raises:
        InputError: neither or both of ``prompt`` and ``messages``; template errors.
    """
    if (prompt is None) == (messages is None):
        raise InputError("give exactly one of 'prompt' and 'messages'", field="prompt")
    if messages is not None:
        if not messages:
            raise InputError("messages is empty", field="messages", lead=True)
        defanger = Defanger(tokenizer)
        return defanger.encode(render_messages(tokenizer, messages, tools, defanger, template_kwargs))
    if parse_special_tokens:
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return _plain_ids(tokenizer, prompt, add_special_tokens=True)
