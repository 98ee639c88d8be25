"""The API key, in every form a server could echo it, kept out of what calm shows or keeps.

:func:`redact` is the one filter every text from an endpoint passes before calm logs,
prints, raises, caches or writes it (an adapter, a report); :func:`redact_fields` is the
same over the strings of one answer taken together, so that a key cut into pieces spread
over consecutive fields (tokens, alternatives) goes too. They remove:

* the key itself, case-folded (an upper-cased echo is the same secret), reversed, and its
  UTF-8 bytes in hex (``invalid key 736b2d...``);
* any run of at least :data:`MIN_FRAGMENT` consecutive characters of any of these (twice
  that many hex digits): a key cut short, "all but its last 3 characters";
* each of them written with escapes or hidden characters between its characters: HTML
  character references (``&#115;``, ``&#x73;``, named ones, escaped again as ``&amp;#115;``),
  ``\\u0073``/``\\u{73}``/``\\x73`` escapes (a backslash doubled any number of times),
  percent-encoding, zero-width and other invisible format characters, line breaks (a key
  wrapped over lines, a literal ``\\n`` among them);
* its percent-encoded forms (``quote``, ``quote_plus``, either hex case) and its JSON-escaped
  forms, once and twice escaped;
* its base64 forms, standard and URL-safe, at any alignment inside a longer encoded string,
  MIME-style wrapped over lines or not (``Basic base64(user:key)`` among them): the whole
  base64 run that carries it goes;
* any ``Bearer <token>`` and ``Authorization: ...`` value, whatever the key.

A key shorter than :data:`MIN_KEY_LENGTH` is refused where it is read
(:meth:`~calm_training.scoring.endpoint.Endpoint.request`): removing such a string from
answers would remove ordinary text with it.
"""

from __future__ import annotations

import base64
import binascii
import html.entities
import json
import re
import urllib.parse
from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache

__all__ = ["MIN_FRAGMENT", "MIN_KEY_LENGTH", "REDACTED", "redact", "redact_fields"]

#: the text that replaces a credential
REDACTED = "[redacted]"
#: the shortest run of the key's characters that is removed on its own
MIN_FRAGMENT = 8
#: the shortest key calm sends. Every text from an endpoint loses each run of
#: :data:`MIN_FRAGMENT` of the key's characters (case-folded, reversed, in hex), so the key
#: must be a string that no answer holds by chance: shorter ones are words and placeholders
#: ("A", "EMPTY", "secret") that redaction would cut out of answers and JSON field names. 12
#: characters of a random key are one of 36**12 (about 5e18) case-folded strings, and each
#: of their 5 runs of 8 is one of 36**8 (about 3e12); vLLM's documented example key,
#: ``token-abc123``, has 12.
MIN_KEY_LENGTH = 12
#: ``Bearer <token>`` (RFC 6750's b64token, one that looks like a credential: a digit or one
#: of ``_~+/-`` in it, or 16 characters long, so that "the bearer of" stays prose) and an
#: ``Authorization`` header's value, as a server may echo them: a header line, JSON, or a
#: Python dict's repr
_CREDENTIALS = re.compile(
    r"""(?i)\b(bearer)\s+(?=[\w.~+/-]*[\d_~+/-]|[\w.~+/-]{16})[\w.~+/-]+=*"""
    r"""|\b(authorization)(["']?\s*[:=]\s*["']?)[^\r\n"',;}]*""", re.ASCII)
#: a run of base64 characters (both alphabets, padding included)
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]+=*")
#: ``Basic <token>``: HTTP Basic credentials
_BASIC = re.compile(r"(?i)\bbasic\s+([A-Za-z0-9+/_-]+=*)")
#: characters that show as nothing: zero-width, joiners, direction marks, soft hyphen, BOM
_INVISIBLE = "\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f" \
             "\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
#: what :class:`_View` decodes (an escape, a character reference) or drops (a line break,
#: an invisible character; an escaped line break)
_SPECIAL = re.compile(
    r"&(?:amp;)*#[xX](?P<hex>[0-9a-fA-F]{1,8});?"
    r"|&(?:amp;)*#(?P<dec>[0-9]{1,8});?"
    r"|&(?:amp;)*(?P<name>[A-Za-z][A-Za-z0-9]{1,31};)"
    r"|\\+u\{(?P<brace>[0-9a-fA-F]{1,8})\}"
    r"|\\+u(?P<u>[0-9a-fA-F]{4})"
    r"|\\+U(?P<U>[0-9a-fA-F]{8})"
    r"|\\+x(?P<x>[0-9a-fA-F]{2})"
    r"|%(?P<pct>[0-9a-fA-F]{2})"
    rf"|(?P<drop>\\+[rn]|[\r\n{_INVISIBLE}])")
#: a decoded character the view drops as well
_DROPPED = re.compile(rf"[\r\n{_INVISIBLE}]")


def _decoded(match: re.Match) -> str | None:
    """What a :data:`_SPECIAL` match reads as (``None``: not a character after all)."""
    if match.group("drop") is not None:
        return ""
    if match.group("name") is not None:
        decoded = html.entities.html5.get(match.group("name"))
        return None if decoded is None else _DROPPED.sub("", decoded)
    for group, base in (("hex", 16), ("dec", 10), ("brace", 16), ("u", 16), ("U", 16),
                        ("x", 16), ("pct", 16)):
        if match.group(group) is not None:
            code = int(match.group(group), base)
            return _DROPPED.sub("", chr(code)) if code <= 0x10FFFF else None
    return None


class _View:
    """``text`` as a reader sees it: escapes and character references decoded, line breaks
    and invisible characters dropped; :meth:`raw` maps a span of it back to ``text``."""

    def __init__(self, text: str) -> None:
        parts: list[str] = []
        # segments: view start, raw start, raw end, whether copied character for character
        self._v0: list[int] = []
        self._seg: list[tuple[int, int, bool]] = []
        pos = size = 0
        for match in _SPECIAL.finditer(text):
            decoded = _decoded(match)
            if decoded is None:
                continue
            if match.start() > pos:
                self._add(size, pos, match.start(), True)
                parts.append(text[pos:match.start()])
                size += match.start() - pos
            self._add(size, match.start(), match.end(), False)
            parts.append(decoded)
            size += len(decoded)
            pos = match.end()
        if self._v0 and pos < len(text):
            self._add(size, pos, len(text), True)
            parts.append(text[pos:])
        self.text = "".join(parts) if self._v0 else text
        lower = self.text.lower()
        if len(lower) != len(self.text):  # a character whose lower case is longer
            lower = "".join(c if len(c.lower()) != 1 else c.lower() for c in self.text)
        self.lower = lower

    def _add(self, view_start: int, start: int, end: int, copied: bool) -> None:
        self._v0.append(view_start)
        self._seg.append((start, end, copied))

    def raw(self, start: int, end: int) -> tuple[int, int]:
        """The span of the original text that view characters ``start:end`` come from."""
        if not self._v0:
            return start, end
        i = bisect_right(self._v0, start) - 1
        first, last, copied = self._seg[i]
        raw_start = first + (start - self._v0[i]) if copied else first
        j = bisect_right(self._v0, end - 1) - 1
        first, last, copied = self._seg[j]
        raw_end = first + (end - self._v0[j]) if copied else last
        return raw_start, raw_end


def _alternation(forms, flags=0) -> re.Pattern | None:
    forms = sorted({f for f in forms if f}, key=len, reverse=True)
    return re.compile("|".join(re.escape(f) for f in forms), flags) if forms else None


@lru_cache(maxsize=16)
def _forms(key: str):
    """``(whole forms, targets, windows, base64 cores)`` of ``key``: the whole forms as a
    pattern; the lower-cased strings whose runs are removed (the key, reversed, in hex); the
    pattern of their shortest removed runs; the base64 cores as a pattern (None: none)."""
    escaped = json.dumps(key)[1:-1]
    whole = {key, urllib.parse.quote(key, safe=""), urllib.parse.quote_plus(key, safe=""),
             urllib.parse.quote(key), escaped, json.dumps(escaped)[1:-1],
             json.dumps(key, ensure_ascii=False)[1:-1]}
    folded = key.lower()
    targets = ((folded, MIN_FRAGMENT), (folded[::-1], MIN_FRAGMENT),
               (key.encode("utf-8").hex(), 2 * MIN_FRAGMENT))
    windows = set()
    for target, width in targets:
        width = min(width, len(target))
        windows |= {target[i:i + width] for i in range(len(target) - width + 1)}
    # base64 at each of the three alignments: the characters that depend on the key alone
    cores = set()
    raw = key.encode("utf-8")
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode("ascii")
        start = -(-shift * 4 // 3) + (1 if shift else 0)  # past the prefix's characters
        end = (shift + len(raw)) // 3 * 4  # before the characters the tail pads
        core = encoded[start:end]
        if len(core) >= 6:
            cores |= {core, core.replace("+", "-").replace("/", "_")}
    return (_alternation(whole, re.IGNORECASE), tuple(t for t, _ in targets),
            _alternation(windows), _alternation(cores))


def _runs(view: _View, targets: Sequence[str], windows: re.Pattern) -> list[tuple[int, int]]:
    """The spans of ``view`` (lower-cased) that are runs of a target holding a window, each
    extended as far as the text goes on following that target."""
    text, spans, pos = view.lower, [], 0
    while (match := windows.search(text, pos)) is not None:
        start, end = match.span()
        frag, best = text[start:end], end
        for target in targets:
            j = target.find(frag)
            while j != -1:
                t, k = end, j + len(frag)
                while t < len(text) and k < len(target) and text[t] == target[k]:
                    t, k = t + 1, k + 1
                best = max(best, t)
                j = target.find(frag, j + 1)
        spans.append((start, best))
        pos = best
    return spans


def _decodes_to_key(token: str, key: str) -> bool:
    padded = token + "=" * (-len(token) % 4)
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            text = decode(padded).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            continue
        if key in text or (len(key) >= MIN_FRAGMENT and redact(text, key) != text):
            return True
    return False


def _encoded_spans(text: str, key: str, view: _View) -> list[tuple[int, int]]:
    """The spans of ``text`` that carry ``key`` base64-encoded, as HTTP Basic credentials,
    percent-encoded or JSON-escaped."""
    whole_re, _, _, cores_re = _forms(key)
    spans = [m.span() for m in whole_re.finditer(text)]
    if cores_re is not None and cores_re.search(view.text):
        spans += [view.raw(*m.span()) for m in _BASE64_RUN.finditer(view.text)
                  if cores_re.search(m.group(0))]
    if "basic" in text.lower():
        spans += [m.span(1) for m in _BASIC.finditer(text) if _decodes_to_key(m.group(1), key)]
    return spans


def redact_fields(texts: Sequence[str], key: str | None = None) -> list[str]:
    """``texts`` (the strings of one answer, in order) without the API key ``key`` in any
    of the forms of the module's docstring, in any one of them or its runs spread over
    consecutive ones, and without any ``Bearer``/``Authorization`` value."""
    texts = list(texts)
    if key:
        whole_re, targets, windows_re, cores_re = _forms(key)
        joined = "\u2063".join(texts)  # an invisible separator: the view reads across it
        view = _View(joined)
        runs = [view.raw(*span) for span in _runs(view, targets, windows_re)]
        encoded = (whole_re.search(joined) or "basic" in joined.lower()
                   or (cores_re is not None and cores_re.search(view.text)))
        out, start = [], 0
        for text in texts:
            end = start + len(text)
            spans = [(max(a, start) - start, min(b, end) - start) for a, b in runs
                     if a < end and b > start]
            # an encoded form within one string (a base64 run stops at the string's end)
            if encoded:
                spans += _encoded_spans(text, key, _View(text) if len(texts) > 1 else view)
            out.append(_replace(text, spans) if spans else text)
            start = end + 1
        texts = out
    return [_CREDENTIALS.sub(_mask, text) for text in texts]


def redact(text: str, key: str | None = None) -> str:
    """``text`` without the API key ``key`` in any of the forms of the module's docstring,
    and without any ``Bearer``/``Authorization`` value."""
    return redact_fields([text], key)[0]


def _replace(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each run of overlapping or touching ``spans`` replaced by one
    :data:`REDACTED`."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    out, pos = [], 0
    for start, end in merged:
        out += [text[pos:start], REDACTED]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _mask(match: re.Match) -> str:
    if match.group(1):
        return f"{match.group(1)} {REDACTED}"
    return f"{match.group(2)}{match.group(3)}{REDACTED}"
