"""Scoring passes over a backend: next-token logits and cloze continuation log-probabilities.

These reproduce ``calm_training.scoring`` on the engine (same prompts, same token ids,
same positions): contexts are left-padded, each question's context runs once and its
KV cache is repeated for every option, and the right-padded continuations run on top
with positions that continue the context. Only the continuation tokens before the last
are fed (the last token's probability comes from the step before it), so single-token
options cost no extra forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._generation import initial_positions, left_pad

__all__ = ["next_token_logits", "cloze_logprobs", "log_softmax_at"]


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield list(range(start, min(n, start + size)))


def next_token_logits(backend, sequences: Sequence[Sequence[int]], pad_id: int,
                      batch_size: int) -> np.ndarray:
    """Calibrated logits ``[N, V]`` at the last position of each sequence."""
    out = []
    size = _limit(backend, batch_size)
    for chunk in _chunks(len(sequences), size):
        ids, mask = left_pad([sequences[i] for i in chunk], pad_id)
        logits, _ = backend.run(ids, mask, initial_positions(mask), None, last_only=True)
        out.append(logits[:, -1])
    return np.concatenate(out, axis=0)


def log_softmax_at(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``log softmax(logits)[..., token]`` (float64) for logits ``[..., V]``, tokens ``[...]``."""
    top = logits.max(axis=-1, keepdims=True)
    log_sum = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64))
    picked = np.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
    return (picked - top[..., 0]).astype(np.float64) - log_sum


def cloze_logprobs(backend, contexts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[Sequence[int]]], pad_id: int,
                   batch_size: int) -> list[np.ndarray]:
    """Summed log-probability of each continuation after its context, one array per question."""
    results: list[np.ndarray] = [np.zeros(len(c)) for c in continuations]
    rows_limit = backend.max_batch or (1 << 30)
    size = _limit(backend, batch_size)
    for chunk in _chunks(len(contexts), size):
        ids, mask = left_pad([contexts[i] for i in chunk], pad_id)
        logits, state = backend.run(ids, mask, initial_positions(mask), None, last_only=True)
        first = logits[:, -1]
        owners = [(b, i, k) for b, i in enumerate(chunk) for k in range(len(continuations[i]))]
        for start in range(0, len(owners), rows_limit):
            part = owners[start:start + rows_limit]
            conts = [continuations[i][k] for _, i, k in part]
            own = np.asarray([b for b, _, _ in part], dtype=np.int64)
            values = _continuations(backend, state, mask, first, own, conts, pad_id)
            for (_, i, k), value in zip(part, values, strict=True):
                results[i][k] = value
    return results


def _continuations(backend, state, ctx_mask, first, own, conts, pad_id) -> np.ndarray:
    width = max(len(c) for c in conts)
    targets = np.zeros((len(conts), width), dtype=np.int64)
    real = np.zeros((len(conts), width), dtype=bool)
    for m, cont in enumerate(conts):
        targets[m, :len(cont)] = cont
        real[m, :len(cont)] = True
    step_logits = first[own][:, None, :]
    if width > 1:
        fed = np.where(real[:, :-1], targets[:, :-1], pad_id)
        fed_mask = real[:, :-1].astype(np.int64)
        owner_mask = ctx_mask[own]
        full_mask = np.concatenate([owner_mask, fed_mask], axis=1)
        positions = owner_mask.sum(axis=1, keepdims=True) + np.arange(width - 1)[None, :]
        logits, _ = backend.run(fed, full_mask, positions.astype(np.int64),
                                backend.select(state, own))
        step_logits = np.concatenate([step_logits, logits], axis=1)
    logp = log_softmax_at(step_logits, targets)
    return np.where(real, logp, 0.0).sum(axis=1)


def _limit(backend, batch_size: int) -> int:
    return max(1, min(batch_size, backend.max_batch or batch_size))
