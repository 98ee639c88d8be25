"""A decode batch whose rows come and go between steps (continuous batching).

:class:`DecodeBatch` holds the rows decoding together: their KV cache, attention masks,
positions and the logits their next token is chosen from. Between two steps a caller may

* :meth:`~DecodeBatch.admit` new rows: their prompts are prefilled (within the backend's
  :class:`~calm_runtime.inference.generation.PrefillBudget`) and their caches joined to the
  running ones (``backend.assemble``: left-padded to the widest row, or each row at the start
  of its buffer on a packed graph);
* :meth:`~DecodeBatch.choose` the next token of every row (each row with its own sampling
  settings, generator, stop strings, alternatives and limit), which finishes rows that hit
  end-of-sequence, a stop string or their limit;
* :meth:`~DecodeBatch.drop` rows whose callers gave up;
* :meth:`~DecodeBatch.advance` the rows that go on by one forward pass over their chosen
  tokens (finished rows leave the cache first, ``backend.select``).

A row decodes as if alone: its cache, mask and positions are its own, padding is masked, and
its generator is the one a call with it alone would use. :class:`GenerationRun` (one call's
rows, admitted at once) and ``calm serve``'s step scheduler (rows admitted as requests
arrive) both decode through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from calm_runtime.inference.prefill import initial_positions, left_pad, prefill
from calm_runtime.inference.results import Alternative, Generation, Timing, Token
from calm_runtime.inference.sampling import (
    SamplingParams,
    choose_row_tokens,
    raw_log_softmax,
    step_stats,
    top_alternatives,
)
from calm_runtime.inference.tokenization import EngineTokenizer, IncrementalDecoder

__all__ = ["DecodeBatch", "RowSpec", "find_stop"]


@dataclass(frozen=True)
class RowSpec:
    """What one row decodes: its prompt and everything that decides its tokens."""

    prompt: tuple[int, ...]
    max_new_tokens: int  # already capped by the context
    sampling: SamplingParams
    generator: np.random.Generator | None  # None: greedy
    stop: tuple[str, ...] = ()
    top_alternatives: int = 0
    eos_ids: frozenset[int] = frozenset()
    #: each token (and alternative) also gets ``log_softmax(raw_scale · z_cal)``
    raw_scale: float | None = None


@dataclass(eq=False)
class _Row:
    handle: Hashable
    spec: RowSpec
    decoder: IncrementalDecoder
    admitted: float
    text: str = ""
    cut: int | None = None  # where a stop string begins in text
    tokens: list[Token] = field(default_factory=list)
    finish: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    #: characters of the longest stop string (where a stop search starts again)
    longest_stop: int = 0

    def result(self, reason: str | None = None) -> Generation:
        first = self.first_token_at if self.first_token_at is not None else time.perf_counter()
        last = self.last_token_at if self.last_token_at is not None else first
        timing = Timing(prefill_s=first - self.admitted, decode_s=last - first,
                        decode_steps=max(0, len(self.tokens) - 1))
        text = self.text if self.cut is None else self.text[:self.cut]
        return Generation(text=text, tokens=tuple(self.tokens),
                          finish_reason=reason or self.finish or "length",
                          prompt_tokens=len(self.spec.prompt), timing=timing)


class DecodeBatch:
    """The rows decoding together and their cache (see the module docstring). Not
    thread-safe: one thread drives a batch."""

    def __init__(self, backend, tokenizer: EngineTokenizer) -> None:
        self._backend = backend
        self._tok = tokenizer
        self._rows: list[_Row] = []
        self._state = None
        self._mask = np.zeros((0, 0), np.int64)
        self._positions = np.zeros((0, 1), np.int64)
        self._logits: np.ndarray | None = None  # [B, V]: what each row's next token comes from
        self._chosen: np.ndarray | None = None  # the tokens of the last choose, per row

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def handles(self) -> list:
        return [r.handle for r in self._rows]

    @property
    def width(self) -> int:
        """Cache positions of the widest row (the padded width of a left-padded cache)."""
        return int(self._mask.shape[1])

    # ------------------------------------------------------------------ admission
    def admit(self, specs: Sequence[RowSpec], handles: Sequence[Hashable], *,
              should_stop: Callable[[], bool] | None = None) -> None:
        """Prefill ``specs``' prompts and join them to the batch (their first token is chosen
        by the next :meth:`choose`). Only between a :meth:`advance` (or the start) and the next
        :meth:`choose`. ``should_stop`` is asked between prefill passes
        (:class:`~calm_runtime.inference.generation.PrefillStopped` when it answers true)."""
        if not specs:
            return
        if self._chosen is not None:
            raise RuntimeError("admit rows after advance(), before the next choose()")
        started = time.perf_counter()
        prompts = [list(s.prompt) for s in specs]
        needs_cache = any(s.max_new_tokens > 1 for s in specs) or bool(self._rows)
        joining = bool(self._rows)  # the new parts go straight into the running cache
        last, state = prefill(self._backend, prompts, self._tok.pad_token_id,
                              keep_state=needs_cache, should_stop=should_stop, parts=joining)
        _, mask = left_pad(prompts, self._tok.pad_token_id)
        positions = initial_positions(mask)[:, -1:]
        rows = [_Row(h, s, IncrementalDecoder(self._tok, list(s.prompt)), started,
                     longest_stop=max(map(len, s.stop), default=0))
                for h, s in zip(handles, specs, strict=True)]
        if not self._rows:
            self._state, self._mask, self._positions = state, mask, positions
            self._logits = last
        else:
            old, new = len(self._rows), len(rows)
            width = max(self._mask.shape[1], mask.shape[1])
            self._state = self._backend.assemble(
                [(np.arange(old, dtype=np.int64), self._state),
                 *((rows + old, part) for rows, part in state)], old + new, width)
            self._mask = np.concatenate([_left_padded(self._mask, width),
                                         _left_padded(mask, width)])
            self._positions = np.concatenate([self._positions, positions])
            self._logits = np.concatenate([self._logits, last])
        self._rows.extend(rows)

    # ------------------------------------------------------------------ steps
    def choose(self) -> tuple[list[tuple[Hashable, Token]], list[tuple[Hashable, Generation]]]:
        """Choose every row's next token: ``(events, finished)`` — ``(handle, Token)`` per row
        in row order, and ``(handle, Generation)`` of the rows this step finished (they leave
        at the next :meth:`advance`)."""
        if self._chosen is not None:
            raise RuntimeError("choose() twice without advance()")
        stats = step_stats(self._logits)
        n = len(self._rows)
        index = np.arange(n)
        chosen = choose_row_tokens(stats, [r.spec.sampling for r in self._rows],
                                   [r.spec.generator for r in self._rows],
                                   valid=self._tok.vocab_size)
        probs = stats.probability(index, chosen)
        logps = stats.logprob(index, chosen)
        now = time.perf_counter()
        events, finished = [], []
        for b, row in enumerate(self._rows):
            spec = row.spec
            token_id = int(chosen[b])
            text = row.decoder.step(token_id)
            reason = None
            if token_id in spec.eos_ids:
                reason = "eos"
            elif len(row.tokens) + 1 >= spec.max_new_tokens:
                reason = "length"
            if reason is not None:
                text += row.decoder.flush()
            before = len(row.text)
            row.text += text
            if spec.stop and text:
                where = find_stop(row.text, spec.stop, max(0, before - row.longest_stop + 1))
                if where is not None:
                    row.cut, reason = where, "stop"
            raw = None if spec.raw_scale is None else raw_log_softmax(stats.shifted[b],
                                                                      spec.raw_scale)
            top = None
            if spec.top_alternatives:
                alt_ids, alt_p = top_alternatives(stats, b, spec.top_alternatives)
                top = tuple(Alternative(int(i), self._tok.token_text(int(i)), float(p),
                                        None if raw is None else float(raw[i]))
                            for i, p in zip(alt_ids, alt_p, strict=True))
            token = Token(id=token_id, text=text, confidence=float(probs[b]),
                          logprob=float(logps[b]), entropy=float(stats.entropy[b]), top=top,
                          raw_logprob=None if raw is None else float(raw[token_id]))
            row.tokens.append(token)
            if row.first_token_at is None:
                row.first_token_at = now
            row.last_token_at = now
            events.append((row.handle, token))
            if reason is not None:
                row.finish = reason
                finished.append((row.handle, row.result()))
        self._chosen = chosen
        return events, finished

    def drop(self, gone: Callable[[Hashable], bool]) -> list[tuple[Hashable, Generation]]:
        """Finish (``"cancelled"``) the unfinished rows whose handle ``gone`` answers true for;
        between a :meth:`choose` and its :meth:`advance`."""
        out = []
        for row in self._rows:
            if row.finish is None and gone(row.handle):
                row.finish = "cancelled"
                out.append((row.handle, row.result()))
        return out

    def advance(self) -> None:
        """Rows finished since the last step leave; the others run one forward pass over
        the tokens :meth:`choose` gave them."""
        if self._chosen is None:
            raise RuntimeError("advance() before choose()")
        keep = [b for b, row in enumerate(self._rows) if row.finish is None]
        chosen, self._chosen = self._chosen, None
        if not keep:
            self.clear()
            return
        if len(keep) < len(self._rows):
            idx = _swap_removed(keep, len(self._rows))
            self._state = self._backend.compact(self._state, idx)
            self._mask, self._positions = self._mask[idx], self._positions[idx]
            self._rows = [self._rows[b] for b in idx]
            chosen = chosen[idx]
            # a column every remaining row pads is dropped (the widest row left)
            self._trim()
        self._mask = np.concatenate([self._mask, np.ones((len(keep), 1), np.int64)], axis=1)
        self._positions = self._positions + 1
        logits, self._state = self._backend.run(chosen[:, None].astype(np.int64), self._mask,
                                                self._positions, self._state, last_only=True)
        self._logits = logits[:, -1]

    def _trim(self) -> None:
        """Drop the leading cache columns every row pads (the rows that held the width have
        left), so that a batch that never empties does not grow without bound."""
        used = self._mask.any(axis=0)
        first = int(np.argmax(used)) if used.any() else 0
        if first > 0:
            self._mask = self._mask[:, first:]
            self._state = self._backend.crop(self._state, first)

    def clear(self) -> None:
        """Forget every row and the cache."""
        self._rows, self._state, self._logits, self._chosen = [], None, None, None
        self._mask = np.zeros((0, 0), np.int64)
        self._positions = np.zeros((0, 1), np.int64)


def _swap_removed(keep: list[int], n: int) -> np.ndarray:
    """The new row order when only the rows ``keep`` (sorted) of ``n`` stay: each place left
    below ``len(keep)`` is taken by a row from the end, the others stay where they are (so
    a backend moves only those rows, :meth:`Backend.compact`)."""
    m = len(keep)
    tail = iter(k for k in keep if k >= m)
    kept = set(keep)
    return np.asarray([i if i in kept else next(tail) for i in range(m)], dtype=np.int64)


def _left_padded(mask: np.ndarray, width: int) -> np.ndarray:
    if mask.shape[1] == width:
        return mask
    return np.concatenate([np.zeros((mask.shape[0], width - mask.shape[1]), mask.dtype), mask],
                          axis=1)


def find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """The earliest index at or after ``start`` where a stop string begins, if any."""
    best = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best):
            best = at
    return best
