"""The decode loop: a numpy loop over a backend with the KV cache.

One :class:`GenerationRun` per call holds all per-call state (nothing is shared between
calls, so many threads can generate on one backend). Rows are left-padded; a row that
finishes is dropped from the batch (its KV rows are removed with ``backend.select``), so
the remaining rows run as if alone. A row whose caller gave up (the ``cancelled`` check,
asked between decode steps) is dropped the same way, with ``finish_reason="cancelled"``.
Timing excludes the time the consumer of a stream spends between tokens.

The rows decode through one :class:`~calm_runtime.inference.continuous.DecodeBatch`; the
prompts are prefilled first (:mod:`calm_runtime.inference.prefill`, whose names this module
also gives for its callers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from calm_runtime.inference.continuous import DecodeBatch, RowSpec
from calm_runtime.inference.prefill import (
    ATTENTION_BUFFERS,
    DEFAULT_MAX_PREFILL_TOKENS,
    PREFILL_BYTES_PER_TOKEN,
    PrefillBudget,
    PrefillStopped,
    initial_positions,
    left_pad,
    prefill,
    release,
    released,
)
from calm_runtime.inference.results import Generation, Timing, Token
from calm_runtime.inference.sampling import SamplingParams, row_generators
from calm_runtime.inference.tokenization import EngineTokenizer

__all__ = ["GenerationRun", "DecodeSettings", "left_pad", "initial_positions", "PrefillBudget",
           "PrefillStopped", "prefill", "release", "released", "DEFAULT_MAX_PREFILL_TOKENS",
           "PREFILL_BYTES_PER_TOKEN", "ATTENTION_BUFFERS"]

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
        error = None
        try:
            yield from self._decode()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the release
            error = exc.with_traceback(None)  # _decode's frame (its KV state) goes here
        # the run's cache is gone: the backend may give its memory back
        release(self._backend)
        if error is not None:
            raise error

    def row_specs(self) -> list[RowSpec]:
        """Each row's :class:`~calm_runtime.inference.continuous.RowSpec` (row ``i`` of the
        whole call keeps generator ``row_offset + i``)."""
        s = self._settings
        n = len(self._prompts)
        generators = ([None] * n if s.sampling.greedy
                      else row_generators(s.sampling.seed, s.row_offset + n)[s.row_offset:])
        return [RowSpec(tuple(p), s.max_new_tokens[i], s.sampling, generators[i], s.stop,
                        s.top_alternatives, s.eos_ids, s.raw_scale)
                for i, p in enumerate(self._prompts)]

    def _decode(self) -> Iterator[tuple[int, Token]]:
        n = len(self._prompts)
        batch = DecodeBatch(self._backend, self._tok)
        results: list[Generation | None] = [None] * n
        # a run whose rows all stop after their first token needs no cache
        gave_up = (None if self._cancelled is None
                   else lambda: all(self._cancelled(r) for r in range(n)))
        started = time.perf_counter()
        try:
            batch.admit(self.row_specs(), range(n), should_stop=gave_up)
        except PrefillStopped:  # every row was cancelled before its first token
            timing = Timing(prefill_s=time.perf_counter() - started, decode_s=0.0,
                            decode_steps=0)
            self.results = [Generation(text="", tokens=(), finish_reason="cancelled",
                                       prompt_tokens=len(p), timing=timing)
                            for p in self._prompts]
            return
        while len(batch):
            events, finished = batch.choose()
            for row, generation in finished:
                results[row] = generation
            yield from events
            if self._cancelled is not None:
                for row, generation in batch.drop(self._cancelled):
                    results[row] = generation
            batch.advance()
        self.results = results
