"""The engine's tokenizer: ``tokenizers`` only (no transformers), plus the chat template.

Encoding follows the engine manifest, not the tokenizer's post-processor: a context gets
the BOS token exactly when ``model.add_bos`` says transformers' tokenizer adds one (what
training saw); continuations and chat-rendered prompts get no special tokens. The chat
template is rendered with jinja2 the way transformers renders it (sandboxed environment,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``, ``strftime_now``,
the special tokens as variables). Every object here is read-only after construction, so
one instance is shared by all threads; per-sequence decoding state lives in
:class:`IncrementalDecoder`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.files import read_regular_file
from calm_runtime.formats.manifest import MAX_MANIFEST_BYTES, parse_json

__all__ = ["EngineTokenizer", "IncrementalDecoder"]

logger = logging.getLogger(__name__)

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                 "mask_token")
#: tokens kept before the new ones when decoding incrementally (enough for any merge context)
_DECODE_CONTEXT = 6
#: a UTF-8 character has at most 4 bytes: text held back longer than this is invalid bytes
_MAX_HELD = 4
#: the largest chat_template.jinja read (real templates have a few kilobytes)
_MAX_TEMPLATE_BYTES = 16 << 20


class EngineTokenizer:
    """Encode, decode and render chat prompts for one engine directory (thread-safe)."""

    def __init__(self, manifest) -> None:
        from tokenizers import Tokenizer

        path = manifest.path("tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - the Rust parser raises plain Exceptions
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ArtifactError(f"{path} cannot be read by the tokenizers library ({reason}); "
                                "copy the engine again or re-export it") from None
        # a tokenizer.json may carry padding/truncation settings; calm pads and checks lengths
        # itself, and the shared object must never be reconfigured later
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tokenizer = tokenizer
        #: texts longer than this many characters are refused before tokenising (set by the
        #: runtime from the model's context; None: no cap)
        self.max_chars: int | None = None
        model = manifest.model
        self.bos_token_id: int | None = model["bos_token_id"]
        self.eos_token_ids: tuple[int, ...] = tuple(model["eos_token_ids"])
        self.pad_token_id: int = (model["pad_token_id"] if model["pad_token_id"] is not None
                                  else (self.eos_token_ids[0] if self.eos_token_ids else 0))
        self.add_bos: bool = bool(model["add_bos"] and self.bos_token_id is not None)
        config = _read_json(manifest, "tokenizer_config.json")
        self._special = self._special_tokens(config, manifest)
        self.chat_template: str | None = self._find_chat_template(manifest, config)
        self._compiled = None
        if self.chat_template is not None:
            self._compiled = _compile_template(self.chat_template)

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` without the post-processor; BOS first when ``add_bos``.

        ``add_bos=None`` follows the manifest (a context, as training encoded it);
        ``False`` is for continuations and chat-rendered prompts.
        """
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ConfigError(f"a text of {len(text):,} characters cannot fit the model's "
                              f"context (at most {self.max_chars:,} characters are tokenised); "
                              "shorten it")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return list(ids)

    def encode_chat(self, messages: str | Sequence[Mapping[str, Any]], *,
                    allow_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered conversation. A message whose content holds the text
        of a special token (``</s>``, ``<|im_start|>`` ...) has that text encoded as plain
        text, so no message can forge a turn or a role; ``allow_special_tokens=True``
        encodes the rendered text as a whole, as transformers does. Other messages encode
        exactly as the whole rendered text would."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        plain = [dict(m) for m in messages]
        specials = self._special_texts()
        risky = [] if allow_special_tokens else [
            i for i, m in enumerate(plain)
            if isinstance(m.get("content"), str) and any(t in m["content"] for t in specials)]
        if not risky:
            return self.encode(self.render_chat(plain), add_bos=False)
        contents = {}
        for i in risky:
            marker = f"\ue000calm-content-{i}\ue001"
            contents[marker] = plain[i]["content"]
            plain[i]["content"] = marker
        rendered = self.render_chat(plain)
        pattern = "(" + "|".join(re.escape(m) for m in contents) + ")"
        ids: list[int] = []
        for piece in re.split(pattern, rendered):
            if piece in contents:
                ids += self._plain_text_ids(contents[piece])
            elif piece:
                ids += self.encode(piece, add_bos=False)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` stands for (OpenAI's ``bytes``), from its piece
        in the vocabulary: byte-level BPE pieces through the byte alphabet, ``<0xNN>``
        byte-fallback pieces as that byte, ``▁`` as a space; a partial UTF-8 character
        keeps its real bytes (decoded text would lose them)."""
        piece = self._tokenizer.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self._is_byte_level():
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode("utf-8")  # an added token stored as text
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def _is_byte_level(self) -> bool:
        cached = getattr(self, "_byte_level", None)
        if cached is None:
            spec = json.loads(self._tokenizer.to_str()).get("decoder") or {}
            cached = "ByteLevel" in json.dumps(spec)
            self._byte_level = cached
        return cached

    def _special_texts(self) -> tuple[str, ...]:
        cached = getattr(self, "_specials_cache", None)
        if cached is None:
            cached = tuple(t.content for t in self._tokenizer.get_added_tokens_decoder().values()
                           if t.special and t.content)
            self._specials_cache = cached
        return cached

    def _plain_text_ids(self, text: str) -> list[int]:
        """``text`` with special-token text encoded as ordinary text (a second tokenizer, so
        the shared one is never reconfigured)."""
        split = getattr(self, "_split_tokenizer", None)
        if split is None:
            from tokenizers import Tokenizer

            split = Tokenizer.from_str(self._tokenizer.to_str())
            split.encode_special_tokens = True
            self._split_tokenizer = split
        return list(split.encode(text, add_special_tokens=False).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` without the post-processor, and each token's ``(start,
        end)`` characters in ``text``."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool | None = None) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos) for t in texts]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def single_token_id(self, text: str, what: str) -> int:
        """The id of ``text`` as exactly one token, or a ConfigError naming the split."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ConfigError(f"{what} {text!r} is {len(ids)} tokens in this tokenizer ({ids}), "
                              "not one; use a template whose answer tokens are single tokens")
        return int(ids[0])

    def token_text(self, token_id: int) -> str:
        """A token's text as it reads in a sentence (special tokens by name)."""
        return self._tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def longest_token_chars(self) -> int:
        """Characters of the longest token string in the vocabulary."""
        return max((len(t) for t in self._tokenizer.get_vocab(with_added_tokens=True)),
                   default=1) or 1

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_template(self) -> bool:
        return self._compiled is not None

    def use_chat(self, chat: bool | None) -> bool:
        """``chat=None``: use the template when there is one (training's default)."""
        if chat and not self.has_chat_template:
            raise ConfigError("this engine's tokenizer has no chat template; pass chat=False "
                              "(--no-chat) or export a model with a chat template")
        return self.has_chat_template if chat is None else bool(chat)

    def render_chat(self, messages: str | Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True) -> str:
        """The prompt text transformers' ``apply_chat_template(..., tokenize=False)`` gives."""
        if self._compiled is None:
            raise ConfigError("this engine's tokenizer has no chat template; pass chat=False")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        plain = [dict(m) for m in messages]
        for message in plain:
            if "role" not in message or "content" not in message:
                raise ConfigError(f"chat message {message!r} lacks 'role' or 'content'; pass "
                                  "messages as {'role': 'user', 'content': '...'}")
        import jinja2

        _RENDER_BUDGET.left = TEMPLATE_MAX_ITERATIONS
        try:
            pieces, size = [], 0
            for piece in self._compiled.generate(messages=plain,
                                                 add_generation_prompt=add_generation_prompt,
                                                 tools=None, documents=None, **self._special):
                size += len(piece)
                if size > TEMPLATE_MAX_CHARS:
                    raise ConfigError(f"the engine's chat template rendered more than "
                                      f"{TEMPLATE_MAX_CHARS:,} characters for these messages; "
                                      "fix chat_template.jinja or pass chat=False")
                pieces.append(piece)
            return "".join(pieces)
        except jinja2.TemplateError as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"the chat template refused the messages ({reason}); check the "
                              "roles and their order") from None
        except (RecursionError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
            # the template is the engine's data: a bug in it is reported, not raised raw
            reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise ConfigError(f"the engine's chat template failed on these messages "
                              f"({type(exc).__name__}: {reason}); fix chat_template.jinja or "
                              "pass chat=False") from None

    # ------------------------------------------------------------------ loading helpers
    def _special_tokens(self, config: dict, manifest) -> dict[str, str]:
        special: dict[str, str] = {}
        extra = _read_json(manifest, "special_tokens_map.json")
        for source in (extra, config):  # tokenizer_config.json wins, as in transformers
            for key in _SPECIAL_KEYS:
                value = source.get(key)
                if isinstance(value, Mapping):
                    value = value.get("content")
                if isinstance(value, str):
                    special[key] = value
        for key, token_id in (("bos_token", self.bos_token_id),
                              ("eos_token", self.eos_token_ids[0] if self.eos_token_ids else None)):
            if key not in special and token_id is not None:
                text = self._tokenizer.id_to_token(token_id)
                if text is not None:
                    special[key] = text
        return special

    @staticmethod
    def _find_chat_template(manifest, config: dict) -> str | None:
        name = manifest.tokenizer.get("chat_template")
        if name:
            path = manifest.path(name)
            raw = read_regular_file(path, limit=_MAX_TEMPLATE_BYTES, what="chat template")
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"{path} is not UTF-8 text ({exc.reason} at byte "
                                    f"{exc.start}); copy the engine again or re-export "
                                    "it") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template
                     if isinstance(t, Mapping) and isinstance(t.get("name"), str)}
            template = named.get("default")
        return template if isinstance(template, str) and template else None


class IncrementalDecoder:
    """Text of each new token of one sequence, stable under multi-byte characters.

    The text of token ``n`` is ``decode(window + n) - decode(window)``, with a short window
    of earlier tokens (the prompt's tail to begin with) so word-initial spaces come out as
    in the full decode; a token that ends inside a UTF-8 character yields ``""`` and its
    bytes come out with the token that completes the character (or with :meth:`flush`),
    unless 4 tokens pass without completing one (invalid bytes: then they come out as
    replacement characters).
    """

    def __init__(self, tokenizer: EngineTokenizer, prompt_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_DECODE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def step(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read  # tokens whose text is not out yet
        if len(full_text) > len(prefix_text) and (not full_text.endswith("\ufffd")
                                                   or held >= _MAX_HELD):
            new = full_text[len(prefix_text):]
            self._prefix = max(0, len(self._ids) - _DECODE_CONTEXT)
            self._read = len(self._ids)
            # keep the window short so every step decodes a handful of tokens only
            if self._prefix > 4 * _DECODE_CONTEXT:
                drop = self._prefix
                self._ids = self._ids[drop:]
                self._prefix -= drop
                self._read -= drop
            return new
        return ""

    def flush(self) -> str:
        """Text still held back (an unfinished UTF-8 character) at the end of a sequence."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read])
        full_text = self._tok.decode(self._ids[self._prefix:])
        self._read = len(self._ids)
        return full_text[len(prefix_text):]


def _read_json(manifest, name: str) -> dict:
    """A tokenizer JSON file of the engine (bounded in size and depth, finite numbers)."""
    if name not in manifest.tokenizer["files"]:
        return {}
    path: Path = manifest.path(name)
    raw = read_regular_file(path, limit=MAX_MANIFEST_BYTES, what=f"tokenizer file {name}")
    data = parse_json(raw, str(path), "copy the engine again or re-export it")
    return data if isinstance(data, dict) else {}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte."""
    cached = getattr(_byte_decoder, "table", None)
    if cached is None:
        printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                     + list(range(ord("®"), ord("ÿ") + 1)))
        chars, n = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + n)
                n += 1
        cached = {chr(c): b for b, c in zip(printable, chars, strict=True)}
        _byte_decoder.table = cached
    return cached


#: what rendering a chat template may do: iterations of ``range`` (nested loops count
#: together) and characters of output; real templates need a few hundred and a few thousand
TEMPLATE_MAX_ITERATIONS = 100_000
TEMPLATE_MAX_CHARS = 4_000_000
_RENDER_BUDGET = threading.local()


def _compile_template(source: str):
    """A sandboxed jinja2 template with the helpers transformers gives chat templates."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return _dt.datetime.now().strftime(fmt)

    def bounded_range(*args):
        """``range`` counting against the render's iteration budget (nested loops included)."""
        for value in range(*args):
            _RENDER_BUDGET.left = getattr(_RENDER_BUDGET, "left", TEMPLATE_MAX_ITERATIONS) - 1
            if _RENDER_BUDGET.left < 0:
                raise jinja2.exceptions.TemplateError(
                    f"the template looped more than {TEMPLATE_MAX_ITERATIONS:,} times")
            yield value

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["range"] = bounded_range
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - syntax errors, and too deep (RecursionError)
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200] or type(exc).__name__
        raise ArtifactError(f"the engine's chat template does not compile ({reason}); fix "
                            "chat_template.jinja and re-export") from None
