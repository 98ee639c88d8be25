"""Scoring passes over a backend: next-token logits and cloze continuation log-probabilities.

These reproduce ``calm_training.scoring.local`` on the engine (same prompts, same token ids,
same positions): contexts are left-padded, each question's context runs once and its
KV cache is repeated for every option, and the right-padded continuations run on top
with positions that continue the context. Only the continuation tokens before the last
are fed (the last token's probability comes from the step before it), so single-token
options cost no extra forward pass.

Every pass stays within the backend's prefill budget (``backend.prefill_budget``, see
:class:`~calm_runtime.inference.generation.PrefillBudget`): contexts are prefilled as generation
prefills prompts (groups of rows, pieces of positions), and continuations run in row chunks
and position segments whose attention scores fit it as well as :data:`SCORING_BUDGET_BYTES`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from calm_runtime.errors import ConfigError
from calm_runtime.inference.generation import (
    PrefillStopped,
    left_pad,
    prefill,
    released,
)

__all__ = ["next_token_logits", "cloze_logprobs", "log_softmax_at", "ScoringStopped",
           "SCORING_BUDGET_BYTES"]


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield list(range(start, min(n, start + size)))


def next_token_logits(backend, sequences: Sequence[Sequence[int]], pad_id: int,
                      batch_size: int) -> np.ndarray:
    """Calibrated logits ``[N, V]`` at the last position of each sequence."""
    return released(backend, _next_token_logits, backend, sequences, pad_id, batch_size)


def _next_token_logits(backend, sequences, pad_id, batch_size) -> np.ndarray:
    out = []
    size = _limit(backend, batch_size)
    budget = getattr(backend, "prefill_budget", None)
    if budget is not None:  # every sequence is checked before any pass
        for i, sequence in enumerate(sequences):
            budget.check(len(sequence), f"sequence {i + 1} of {len(sequences)}")
    for chunk in _chunks(len(sequences), size):
        logits, _ = prefill(backend, [sequences[i] for i in chunk], pad_id, keep_state=False)
        out.append(logits)
    return np.concatenate(out, axis=0)


def log_softmax_at(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``log softmax(logits)[..., token]`` (float64) for logits ``[..., V]``, tokens ``[...]``."""
    top = logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64))
    picked = np.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return (picked - top[..., 0]).astype(np.float64) - log_sum


#: Bytes one scoring step may allocate for logits and repeated KV rows: continuations are
#: run in row chunks and position segments that fit it, so the memory of a request does not
#: grow with its number of options times their length times the vocabulary.
SCORING_BUDGET_BYTES = 64 << 20


class ScoringStopped(Exception):
    """``should_stop()`` answered true between two steps (a cancelled or timed-out request)."""


def _check(should_stop) -> None:
    if should_stop is not None and should_stop():
        raise ScoringStopped()


def cloze_logprobs(backend, contexts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[Sequence[int]]], pad_id: int,
                   batch_size: int, *, kv_bytes_per_token: int = 0,
                   budget_bytes: int = SCORING_BUDGET_BYTES,
                   should_stop=None) -> list[np.ndarray]:
    """Summed log-probability of each continuation after its context, one array per question.

    Continuations run in row chunks whose repeated KV cache (``kv_bytes_per_token`` per
    token of context and continuation) and logits fit ``budget_bytes``, fed in position
    segments that fit it too; ``should_stop()`` is checked between steps."""
    return released(backend, _cloze_logprobs, backend, contexts, continuations, pad_id,
                    batch_size, kv_bytes_per_token, budget_bytes, should_stop)


def _cloze_logprobs(backend, contexts, continuations, pad_id, batch_size, kv_bytes_per_token,
                    budget_bytes, should_stop) -> list[np.ndarray]:
    results: list[np.ndarray] = [np.zeros(len(c)) for c in continuations]
    rows_limit = backend.max_batch or (1 << 30)
    size = _limit(backend, batch_size)
    prefill_budget = getattr(backend, "prefill_budget", None)
    if prefill_budget is not None:  # every question is checked before any pass
        for i, (context, conts) in enumerate(zip(contexts, continuations, strict=True)):
            label = f"context {i + 1} of {len(contexts)}"
            prefill_budget.check(len(context), label)
            total = len(context) + max((len(c) for c in conts), default=1) - 1
            if prefill_budget.rows(1, total, all_logits=True) < 1:
                raise ConfigError(f"{label} with its longest continuation ({total} tokens) "
                                  "cannot be scored within max_prefill_tokens "
                                  f"{prefill_budget.tokens}; shorten it or raise the limit")
    for chunk in _chunks(len(contexts), size):
        _check(should_stop)
        try:
            first, state = prefill(backend, [contexts[i] for i in chunk], pad_id,
                                   should_stop=should_stop)
        except PrefillStopped:
            raise ScoringStopped() from None
        mask = left_pad([contexts[i] for i in chunk], pad_id)[1]
        owners = [(b, i, k) for b, i in enumerate(chunk) for k in range(len(continuations[i]))]
        width = max(len(continuations[i][k]) for _, i, k in owners)
        row_bytes = (kv_bytes_per_token * (mask.shape[1] + width) * 2
                     + min(width, 64) * first.shape[-1] * 8)
        rows = max(1, min(rows_limit, budget_bytes // max(row_bytes, 1)))
        if prefill_budget is not None and width > 1:  # the attention scores of a segment
            rows = max(1, min(rows, prefill_budget.rows(1, mask.shape[1] + width - 1,
                                                        all_logits=True)))
        for start in range(0, len(owners), rows):
            _check(should_stop)
            part = owners[start:start + rows]
            conts = [continuations[i][k] for _, i, k in part]
            own = np.asarray([b for b, _, _ in part], dtype=np.int64)
            values = _continuations(backend, state, mask, first, own, conts, pad_id,
                                    budget_bytes, should_stop)
            for (_, i, k), value in zip(part, values, strict=True):
                results[i][k] = value
    return results


def _continuations(backend, state, ctx_mask, first, own, conts, pad_id, budget_bytes,
                   should_stop) -> np.ndarray:
    width = max(len(c) for c in conts)
    targets = np.zeros((len(conts), width), dtype=np.int64)
    real = np.zeros((len(conts), width), dtype=bool)
    for m, cont in enumerate(conts):
        targets[m, :len(cont)] = cont
        real[m, :len(cont)] = True
    total = np.where(real[:, 0], log_softmax_at(first[own], targets[:, 0]), 0.0)
    if width == 1:
        return total
    fed = np.where(real[:, :-1], targets[:, :-1], pad_id)
    fed_mask = real[:, :-1].astype(np.int64)
    seen = ctx_mask[own]
    start_positions = seen.sum(axis=1, keepdims=True)
    rows_state = backend.select(state, own)
    vocab = first.shape[-1]
    segment = max(1, budget_bytes // max(len(conts) * vocab * 8, 1))
    prefill_budget = getattr(backend, "prefill_budget", None)
    if prefill_budget is not None:
        segment = min(segment, max(1, prefill_budget.span(
            len(conts), seen.shape[1] + width - 1, all_logits=True)))
    for s in range(0, width - 1, segment):
        _check(should_stop)
        e = min(width - 1, s + segment)
        seen = np.concatenate([seen, fed_mask[:, s:e]], axis=1)
        positions = start_positions + np.arange(s, e)[None, :]
        logits, rows_state = backend.run(fed[:, s:e], seen, positions.astype(np.int64),
                                         rows_state)
        logp = log_softmax_at(logits, targets[:, s + 1:e + 1])
        total = total + np.where(real[:, s + 1:e + 1], logp, 0.0).sum(axis=1)
    return total


def _limit(backend, batch_size: int) -> int:
    return max(1, min(batch_size, backend.max_batch or batch_size))
