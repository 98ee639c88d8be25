"""Token statistics and token choice on calibrated logits (numpy, one pass per step).

Confidence (METHODS.md §2): a token's confidence is its probability under
``softmax(z_cal)`` over the full vocabulary, whatever sampling settings chose it. Per
step and row the statistics come from one pass: ``s = z - max(z)``, ``e = exp(s)``,
``S = sum(e)``; then ``p(t) = e[t] / S``, ``log p(t) = s[t] - log S`` and the entropy
``H = log S - sum(e * s) / S`` from the same exponentials. The top-k alternatives are
found with ``argpartition`` only when asked for.

Sampling (:class:`SamplingParams`): ``temperature == 0`` is greedy (``argmax``, the lowest
id on ties). Otherwise the candidates are the ``top_k`` most probable tokens (all when
``top_k`` is 0), then the smallest most-probable prefix of those whose mass under the
temperature-scaled, renormalised distribution reaches ``top_p``; one uniform draw ``u``
from the row's generator picks the token by inverse CDF over the candidates in ascending
token-id order. Row ``i`` of a call with ``seed`` uses ``SeedSequence(seed).spawn`` child
``i``, so a prompt samples the same tokens alone or in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError

__all__ = ["SamplingParams", "StepStats", "step_stats", "choose_tokens", "row_generators",
           "top_alternatives"]

#: candidates taken by the first ``argpartition`` of top-p sampling without top-k; doubled
#: until they hold the mass (a full sort of a 50k-262k vocabulary costs milliseconds)
_TOP_P_FIRST = 64


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; the reported confidence never depends on it.

    Attributes:
        temperature: 0 for greedy decoding; > 0 samples from ``softmax(z_cal / temperature)``.
        top_k: keep only the ``top_k`` most probable tokens (0: no limit).
        top_p: keep the smallest set of most probable tokens with mass >= ``top_p`` (1: all).
        seed: seed of the per-row generators (``None``: fresh entropy, not reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t < 0:
            problems.append(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            problems.append(f"top_k must be an integer >= 0, got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            problems.append(f"top_p must be in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer))
                              or s < 0):
            problems.append(f"seed must be a non-negative integer or None, got {s!r}")
        if problems:
            raise ConfigError("invalid sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_generators(seed: int | None, n: int) -> list[np.random.Generator]:
    """One generator per batch row; row ``i`` is the same for any batch size."""
    return [np.random.Generator(np.random.PCG64(s))
            for s in np.random.SeedSequence(seed).spawn(n)]


@dataclass
class StepStats:
    """One step's statistics for ``B`` rows (see the module docstring for the formulas)."""

    shifted: np.ndarray  # [B, V] z - max(z)
    exps: np.ndarray  # [B, V] exp(shifted)
    sums: np.ndarray  # [B] sum(exps), float64
    entropy: np.ndarray  # [B] nats

    def probability(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return self.exps[rows, tokens] / self.sums[rows]

    def logprob(self, rows: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return self.shifted[rows, tokens].astype(np.float64) - np.log(self.sums[rows])


def step_stats(logits: np.ndarray) -> StepStats:
    """Probabilities' building blocks and entropy of calibrated ``logits`` ``[B, V]``."""
    z = np.asarray(logits, dtype=np.float32)
    shifted = z - z.max(axis=-1, keepdims=True)
    exps = np.exp(shifted)
    sums = exps.sum(axis=-1, dtype=np.float64)
    weighted = np.einsum("bv,bv->b", exps, shifted, dtype=np.float64)
    entropy = np.log(sums) - weighted / sums
    return StepStats(shifted, exps, sums, np.maximum(entropy, 0.0))


def top_alternatives(stats: StepStats, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable ``(token ids, probabilities)`` of ``row``, most probable first."""
    exps = stats.exps[row]
    k = min(k, exps.size)
    idx = np.argpartition(-exps, k - 1)[:k] if k < exps.size else np.arange(exps.size)
    order = np.lexsort((idx, -exps[idx]))  # by probability, then by id
    idx = idx[order]
    return idx, exps[idx] / stats.sums[row]


def choose_tokens(stats: StepStats, params: SamplingParams,
                  generators: list[np.random.Generator]) -> np.ndarray:
    """The next token of each row (``generators[b]`` draws row ``b``'s uniform)."""
    if params.greedy:
        return stats.shifted.argmax(axis=-1)
    chosen = np.empty(stats.shifted.shape[0], dtype=np.int64)
    for b in range(chosen.size):
        chosen[b] = _sample_row(stats, b, params, generators[b])
    return chosen


def _sample_row(stats: StepStats, row: int, params: SamplingParams,
                generator: np.random.Generator) -> int:
    if params.temperature == 1.0:
        weights = stats.exps[row]
    else:
        weights = np.exp(stats.shifted[row] / np.float32(params.temperature))
    if params.top_k or params.top_p < 1.0:
        candidates = _candidates(weights, params.top_k, params.top_p)
        candidates.sort()
        cumulative = np.cumsum(weights[candidates], dtype=np.float64)
    else:
        candidates = None
        cumulative = np.cumsum(weights, dtype=np.float64)
    # first index whose cumulative weight exceeds u: zero-weight entries are never picked
    u = generator.random() * cumulative[-1]
    pick = min(int(np.searchsorted(cumulative, u, side="right")), cumulative.size - 1)
    return int(candidates[pick]) if candidates is not None else pick


def _candidates(weights: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Ids kept by top-k then top-p (unsorted ids; at least one)."""
    vocab = weights.size
    limit = min(top_k, vocab) if top_k else vocab
    if top_p >= 1.0:
        return _top(weights, limit)
    total = float(weights.sum(dtype=np.float64)) if limit == vocab else None
    take = limit if limit < vocab else min(_TOP_P_FIRST, vocab)
    while True:
        idx = _top(weights, take)
        idx = idx[np.lexsort((idx, -weights[idx]))]
        if total is None:  # top-k: renormalise over the k kept tokens
            total = float(weights[idx].sum(dtype=np.float64))
        before = np.cumsum(weights[idx], dtype=np.float64) - weights[idx]
        keep = int(np.count_nonzero(before < top_p * total))
        if keep < idx.size or take >= limit:
            return idx[:max(keep, 1)]
        take = min(2 * take, limit)


def _top(weights: np.ndarray, k: int) -> np.ndarray:
    if k >= weights.size:
        return np.arange(weights.size)
    return np.argpartition(-weights, k - 1)[:k]
