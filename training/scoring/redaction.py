"""The API key, in every form a server could echo it, kept out of what calm shows or keeps.

:func:`redact` is the one filter every text from an endpoint passes before calm logs,
prints, raises, caches or writes it (an adapter, a report). It removes:

* the key itself, case-folded (an upper-cased echo is the same secret);
* any run of at least :data:`MIN_FRAGMENT` consecutive characters of it (a key cut short,
  "all but its last 3 characters");
* its percent-encoded forms (``quote``, ``quote_plus``, either hex case) and its JSON-escaped
  forms, once and twice escaped;
* its base64 forms, standard and URL-safe, at any alignment inside a longer encoded string
  (``Basic base64(user:key)`` among them): the whole base64 run that carries it goes;
* any ``Bearer <token>`` and ``Authorization: ...`` value, whatever the key.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import urllib.parse
from functools import lru_cache

__all__ = ["MIN_FRAGMENT", "REDACTED", "redact"]

#: the text that replaces a credential
REDACTED = "[redacted]"
#: the shortest run of the key's characters that is removed on its own
MIN_FRAGMENT = 8
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


def _mask(match: re.Match) -> str:
    if match.group(1):
        return f"{match.group(1)} {REDACTED}"
    return f"{match.group(2)}{match.group(3)}{REDACTED}"


def _alternation(forms, flags=0) -> re.Pattern | None:
    forms = sorted({f for f in forms if f}, key=len, reverse=True)
    return re.compile("|".join(re.escape(f) for f in forms), flags) if forms else None


@lru_cache(maxsize=16)
def _forms(key: str):
    """``(whole forms, windows, base64 cores)`` of ``key`` as patterns (None: none)."""
    escaped = json.dumps(key)[1:-1]
    whole = {key, urllib.parse.quote(key, safe=""), urllib.parse.quote_plus(key, safe=""),
             urllib.parse.quote(key), escaped, json.dumps(escaped)[1:-1],
             json.dumps(key, ensure_ascii=False)[1:-1]}
    windows = ({key[i:i + MIN_FRAGMENT] for i in range(len(key) - MIN_FRAGMENT + 1)}
               if len(key) >= MIN_FRAGMENT else set())
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
    return (_alternation(whole, re.IGNORECASE), _alternation(windows, re.IGNORECASE),
            _alternation(cores))


def _fragments(text: str, key: str, windows: re.Pattern) -> str:
    """``text`` with every run of the key's characters that holds a window removed whole
    (each match is extended as far as the text goes on following the key)."""
    lower_t, lower_k = text.lower(), key.lower()
    out, pos = [], 0
    while (match := windows.search(text, pos)) is not None:
        start, end = match.span()
        frag, best = lower_t[start:end], end
        j = lower_k.find(frag)
        while j != -1:
            t, k = end, j + len(frag)
            while t < len(text) and k < len(key) and lower_t[t] == lower_k[k]:
                t, k = t + 1, k + 1
            best = max(best, t)
            j = lower_k.find(frag, j + 1)
        out += [text[pos:start], REDACTED]
        pos = best
    out.append(text[pos:])
    return "".join(out)


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


def redact(text: str, key: str | None = None) -> str:
    """``text`` without the API key ``key`` in any of the forms of the module's docstring,
    and without any ``Bearer``/``Authorization`` value."""
    if key:
        whole_re, windows_re, cores_re = _forms(key)
        if cores_re is not None and cores_re.search(text):
            def run(match: re.Match) -> str:
                return REDACTED if cores_re.search(match.group(0)) else match.group(0)
            text = _BASE64_RUN.sub(run, text)
        if "basic" in text.lower():
            text = _BASIC.sub(lambda m: f"{m.group(0)[:-len(m.group(1))]}{REDACTED}"
                              if _decodes_to_key(m.group(1), key) else m.group(0), text)
        text = whole_re.sub(REDACTED, text)
        if windows_re is not None:
            text = _fragments(text, key, windows_re)
    return _CREDENTIALS.sub(_mask, text)
