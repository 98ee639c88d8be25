"""Token statistics and token choice on calibrated logits (numpy, one pass per step).

Confidence (docs/methods.md §2): a token's confidence is its probability under
``softmax(z_cal)`` over the full vocabulary, whatever sampling settings chose it. Per
step and row the statistics come from one pass: ``s = z - max(z)``, ``e = exp(s)``,
``S = sum(e)``; then ``p(t) = e[t] / S``, ``log p(t) = s[t] - log S`` and the entropy
``H = log S - sum(e * s) / S`` from the same exponentials. The top-k alternatives are
collected only when asked for (a threshold pass, then a sort of the few tokens above it).

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

from calm_runtime.errors import ConfigError

__all__ = ["SamplingParams", "StepStats", "step_stats", "choose_tokens", "choose_row_tokens",
           "row_generators", "top_alternatives"]

#: log-probability margins below the best token tried, in order, when collecting the most
#: probable tokens (top-k, top-p, alternatives): each try is one vectorised comparison over
#: the vocabulary (~0.03 ms for 50k tokens), where a full sort costs ~3 ms and an
#: argpartition ~0.5 ms; peaked distributions stop after one or two tries
_BLOCK = 1024
#: value buckets of the top-p histogram
_BUCKETS = 1024
_HEAD_DELTAS = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, np.inf)
#: the smallest positive float32, the least a temperature divides by
_SMALLEST = np.float32(np.finfo(np.float32).smallest_subnormal)


@dataclass(frozen=True)
class DecodeOptions:
    """Everything one decode call takes besides its prompts and limits, as one value: what
    ``calm serve`` makes of a request once at its edge and hands, unchanged, to the generation
    loop (``CalibratedLM.generation_run(..., decode=...)``), and the keyword options of
    ``CalibratedLM.generate``. Rows of any options decode in one batch (each row with its own).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_alternatives: int = 0
    raw_logprobs: bool = False
    ignore_eos: bool = False

    def as_kwargs(self) -> dict:
        """The options as ``generate``'s keyword arguments."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


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
    # numpy's float32 sums are pairwise (relative error ~1e-7 over a 262k vocabulary): as
    # close as float64 accumulation at a third of its cost, which is a decode step's cost
    sums = exps.sum(axis=-1).astype(np.float64)
    weighted = np.multiply(exps, shifted).sum(axis=-1).astype(np.float64)
    entropy = np.log(sums) - weighted / sums
    return StepStats(shifted, exps, sums, np.maximum(entropy, 0.0))


def raw_log_softmax(shifted: np.ndarray, scale: float) -> np.ndarray:
    """``log_softmax(scale · z_cal)`` of one row (float64): the raw log-probabilities when the
    engine's calibration is one scale of the logits (see ``CalibratedLM.raw_logit_scale``)."""
    z = scale * np.asarray(shifted, dtype=np.float64)
    z -= z.max()
    return z - np.log(np.exp(z).sum())


def top_alternatives(stats: StepStats, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable ``(token ids, probabilities)`` of ``row``, most probable first."""
    ids = _sorted_head(stats.shifted[row], stats.exps[row], count=k)[:k]
    return ids, stats.exps[row][ids] / stats.sums[row]


def choose_tokens(stats: StepStats, params: SamplingParams,
                  generators: list[np.random.Generator], valid: int | None = None) -> np.ndarray:
    """The next token of each row (``generators[b]`` draws row ``b``'s uniform).

    ``valid``: the tokenizer's vocabulary size where the head has more rows (a padded head,
    a config vocabulary past the tokenizer's): the ids from ``valid`` on cannot be rendered
    and are never chosen. Their probability stays in the distribution the confidences are
    read from (the model's own, as an engine's logits and a server's logprobs report it);
    only the choice is restricted, as a banned token is."""
    rows = stats.shifted.shape[0]
    return choose_row_tokens(stats, [params] * rows, list(generators) or [None] * rows, valid)


def choose_row_tokens(stats: StepStats, params: list[SamplingParams],
                      generators: list[np.random.Generator | None],
                      valid: int | None = None) -> np.ndarray:
    """:func:`choose_tokens` with settings of each row's own (``params[b]``,
    ``generators[b]``; a greedy row's generator is not used): what a batch of rows from
    different requests decodes with. Row ``b`` gets the token it would get alone."""
    limit = None if valid is None or valid >= stats.shifted.shape[-1] else int(valid)
    chosen = stats.shifted[:, :limit].argmax(axis=-1)
    for b, p in enumerate(params):
        if not p.greedy:
            chosen[b] = _sample_row(stats, b, p, generators[b], limit)
    return chosen


def _sample_row(stats: StepStats, row: int, params: SamplingParams,
                generator: np.random.Generator, limit: int | None = None) -> int:
    scaled = stats.shifted[row][:limit]
    if params.temperature == 1.0:
        weights = stats.exps[row][:limit]
    else:
        # a temperature below float32's range divides by its smallest step, not by 0: the
        # best token(s) keep weight 1 and the others fall to -inf (weight 0), greedy's limit
        with np.errstate(over="ignore"):
            scaled = scaled / max(np.float32(params.temperature), _SMALLEST)
        weights = np.exp(scaled)
    if params.top_k or params.top_p < 1.0:
        candidates = _candidates(scaled, weights, params.top_k, params.top_p)
        if candidates.size <= 4 * _BLOCK:
            candidates = np.sort(candidates)
            return int(candidates[_inverse_cdf(weights[candidates], generator.random())])
        kept = np.zeros(weights.size, dtype=weights.dtype)  # ids in order without a sort
        kept[candidates] = weights[candidates]
        weights = kept
    return _inverse_cdf(weights, generator.random())


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight exceeds ``u * total`` (zero weights are
    never picked). Long arrays go block by block: a float64 ``cumsum`` over a 262k
    vocabulary costs ~6 ms, block sums and one block's ``cumsum`` ~0.2 ms."""
    n = weights.size
    if n <= 4 * _BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), n - 1)
    blocks = np.cumsum(np.add.reduceat(weights, np.arange(0, n, _BLOCK), dtype=np.float64))
    target = u * blocks[-1]
    b = min(int(np.searchsorted(blocks, target, side="right")), blocks.size - 1)
    inner = np.cumsum(weights[b * _BLOCK:(b + 1) * _BLOCK], dtype=np.float64)
    inner += blocks[b - 1] if b else 0.0
    return b * _BLOCK + min(int(np.searchsorted(inner, target, side="right")), inner.size - 1)


def _candidates(scaled: np.ndarray, weights: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Ids kept by top-k, then top-p over the kept tokens' renormalised weights (>= 1 id).

    ``scaled`` is ``(z - max z) / T`` and ``weights = exp(scaled)``.
    """
    if not top_k:
        if top_p >= 1.0:
            return np.arange(weights.size)
        return _top_p_band(scaled, weights, top_p * float(weights.sum(dtype=np.float64)))
    head = _sorted_head(scaled, weights, count=top_k)[:top_k]
    if top_p >= 1.0:
        return head
    need = top_p * float(weights[head].sum(dtype=np.float64))
    before = np.cumsum(weights[head], dtype=np.float64) - weights[head]
    return head[:max(1, int(np.count_nonzero(before < need)))]


def _top_p_band(scaled: np.ndarray, weights: np.ndarray, need: float) -> np.ndarray:
    """Top-p without top-k. Thresholds from :data:`_HEAD_DELTAS` find a band of values
    where the mass reaches ``need``: tokens above it are kept unsorted; a large band is
    narrowed by one histogram pass over its values; only the rest is sorted to find the
    cut. Values are split monotonically, so ties stay together and the result equals the
    rule applied to a full sort."""
    inner = np.zeros(scaled.shape, dtype=bool)
    inner_mass = 0.0
    for delta in _HEAD_DELTAS:
        mask = scaled >= -delta
        mass = float(np.sum(weights, where=mask, dtype=np.float64))
        if mass >= need:
            break
        inner, inner_mass = mask, mass
    kept = [np.flatnonzero(inner)]
    band = np.flatnonzero(mask & ~inner)
    if band.size > 4 * _BLOCK:
        values = scaled[band]
        low, high = float(values.min()), float(values.max())
        if low < high:
            bucket = ((high - values) * np.float32((_BUCKETS - 1) / (high - low))).astype(np.intp)
            np.clip(bucket, 0, _BUCKETS - 1, out=bucket)  # 0: the highest values
            cumulative = inner_mass + np.cumsum(
                np.bincount(bucket, weights=weights[band], minlength=_BUCKETS))
            crossing = min(int(np.searchsorted(cumulative, need)), _BUCKETS - 1)
            inner_mass = float(cumulative[crossing - 1]) if crossing else inner_mass
            kept.append(band[bucket < crossing])
            band = band[bucket == crossing]
    kept = np.concatenate(kept)
    band = band[np.lexsort((band, -weights[band]))]
    before = inner_mass + np.cumsum(weights[band], dtype=np.float64) - weights[band]
    take = int(np.count_nonzero(before < need))
    return np.concatenate([kept, band[:max(take, 0 if kept.size else 1)]])


def _sorted_head(scaled: np.ndarray, weights: np.ndarray, *, count: int | None = None,
                 mass: float | None = None) -> np.ndarray:
    """Ids of the most probable tokens, sorted by (weight descending, id), holding at least
    ``count`` tokens or ``mass`` weight: every token with ``scaled >= -delta`` for the
    smallest ``delta`` of a fixed schedule that is enough. A value threshold keeps ties
    together, so taking a prefix of the result equals taking one of a full sort."""
    for delta in _HEAD_DELTAS:
        mask = scaled >= -delta
        if count is not None and np.count_nonzero(mask) >= count:
            break
        if mass is not None and np.sum(weights, where=mask, dtype=np.float64) >= mass:
            break
    ids = np.flatnonzero(mask)
    return ids[np.lexsort((ids, -weights[ids]))]
