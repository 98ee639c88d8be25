"""The decode loop: a numpy loop over a backend with the KV cache.

One :class:`GenerationRun` per call holds all per-call state (nothing is shared between
calls, so many threads can generate on one backend). Rows are left-padded; a row that
finishes is dropped from the batch (its KV rows are removed with ``backend.select``), so
the remaining rows run as if alone. A row whose caller gave up (the ``cancelled`` check,
asked between decode steps) is dropped the same way, with ``finish_reason="cancelled"``.
Timing excludes the time the consumer of a stream spends between tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ._tokenizer import EngineTokenizer, IncrementalDecoder
from .results import Alternative, Generation, Timing, Token
from .sampling import (
    SamplingParams,
    choose_tokens,
    raw_log_softmax,
    row_generators,
    step_stats,
    top_alternatives,
)

__all__ = ["GenerationRun", "left_pad", "initial_positions"]


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)`` ``[B, max_len]`` int64, padding on the left."""
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.int64)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, length - len(seq):] = seq
            mask[row, length - len(seq):] = 1
    return ids, mask


def initial_positions(mask: np.ndarray) -> np.ndarray:
    """Position ids that count real tokens only (0 on the padding)."""
    return np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int64)


@dataclass(frozen=True)
class DecodeSettings:
    max_new_tokens: tuple[int, ...]  # per row, already capped by the context
    sampling: SamplingParams
    stop: tuple[str, ...]
    top_alternatives: int
    eos_ids: frozenset[int]
    row_offset: int = 0  # index of the first row in the whole call (selects its generator)
    #: when set, each token (and alternative) also gets its raw log-probability,
    #: ``log_softmax(raw_scale · z_cal)`` (see ``CalibratedLM.raw_logit_scale``)
    raw_scale: float | None = None


class GenerationRun:
    """Iterate ``(row, Token)`` as tokens are chosen; :attr:`results` is filled at the end.

    ``cancelled(row)``, when given, is asked for every unfinished row before each decode
    step (from the decoding thread; it must be cheap and thread-safe): a row it answers
    ``True`` for stops there and leaves the batch, and its result so far has
    ``finish_reason="cancelled"``. The run ends early when every row is cancelled.
    """

    def __init__(self, backend, tokenizer: EngineTokenizer, prompts: Sequence[Sequence[int]],
                 settings: DecodeSettings,
                 cancelled: Callable[[int], bool] | None = None) -> None:
        self._backend = backend
        self._tok = tokenizer
        self._prompts = [list(p) for p in prompts]
        self._settings = settings
        self._cancelled = cancelled
        self.results: list[Generation] | None = None

    def __iter__(self) -> Iterator[tuple[int, Token]]:
        s = self._settings
        n = len(self._prompts)
        generators = None
        if not s.sampling.greedy:
            generators = row_generators(s.sampling.seed, s.row_offset + n)[s.row_offset:]
        decoders = [IncrementalDecoder(self._tok, p) for p in self._prompts]
        texts = [""] * n
        cut = [None] * n  # where a stop string begins in texts[row]
        tokens: list[list[Token]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        longest_stop = max((len(x) for x in s.stop), default=0)

        started = time.perf_counter()
        ids, mask = left_pad(self._prompts, self._tok.pad_token_id)
        positions = initial_positions(mask)[:, -1:]
        logits, state = self._backend.run(ids, mask, initial_positions(mask), None,
                                          last_only=True)
        active = np.arange(n)
        prefill_s, decode_s, steps = 0.0, 0.0, 0
        while True:
            stats = step_stats(logits[:, -1])
            rows = np.arange(active.size)
            chosen = choose_tokens(stats, s.sampling,
                                   [generators[r] for r in active] if generators else [])
            probs = stats.probability(rows, chosen)
            logps = stats.logprob(rows, chosen)
            events, keep = [], []
            for b, row in enumerate(active):
                token_id = int(chosen[b])
                text = decoders[row].step(token_id)
                reason = None
                if token_id in s.eos_ids:
                    reason = "eos"
                elif len(tokens[row]) + 1 >= s.max_new_tokens[row]:
                    reason = "length"
                if reason is not None:
                    text += decoders[row].flush()
                before = len(texts[row])
                texts[row] += text
                if longest_stop and text:
                    where = _find_stop(texts[row], s.stop, max(0, before - longest_stop + 1))
                    if where is not None:
                        cut[row], reason = where, "stop"
                raw = (None if s.raw_scale is None
                       else raw_log_softmax(stats.shifted[b], s.raw_scale))
                top = None
                if s.top_alternatives:
                    alt_ids, alt_p = top_alternatives(stats, b, s.top_alternatives)
                    top = tuple(Alternative(int(i), self._tok.token_text(int(i)), float(p),
                                            None if raw is None else float(raw[i]))
                                for i, p in zip(alt_ids, alt_p, strict=True))
                token = Token(id=token_id, text=text, confidence=float(probs[b]),
                              logprob=float(logps[b]), entropy=float(stats.entropy[b]), top=top,
                              raw_logprob=None if raw is None else float(raw[token_id]))
                tokens[row].append(token)
                events.append((int(row), token))
                if reason is None:
                    keep.append(b)
                else:
                    finish[row] = reason
            now = time.perf_counter()
            if steps == 0:
                prefill_s = now - started
            else:
                decode_s += now - started
            yield from events
            if self._cancelled is not None and keep:
                gone = [b for b in keep if self._cancelled(int(active[b]))]
                for b in gone:
                    finish[active[b]] = "cancelled"
                keep = [b for b in keep if b not in gone]
            if not keep:
                break
            started = time.perf_counter()
            if len(keep) < active.size:
                keep_idx = np.asarray(keep, dtype=np.int64)
                state = self._backend.select(state, keep_idx)
                mask, positions, active = mask[keep_idx], positions[keep_idx], active[keep_idx]
                chosen = chosen[keep_idx]
            mask = np.concatenate([mask, np.ones((active.size, 1), np.int64)], axis=1)
            positions = positions + 1
            logits, state = self._backend.run(chosen[:, None].astype(np.int64), mask, positions,
                                              state, last_only=True)
            steps += 1
        timing = Timing(prefill_s=prefill_s, decode_s=decode_s, decode_steps=steps)
        self.results = [
            Generation(text=texts[r] if cut[r] is None else texts[r][:cut[r]],
                       tokens=tuple(tokens[r]), finish_reason=finish[r] or "length",
                       prompt_tokens=len(self._prompts[r]), timing=timing)
            for r in range(n)]


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    """The earliest index at or after ``start`` where a stop string begins, if any."""
    best = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best):
            best = at
    return best
