"""Prefill: the prompt passes before decoding, within a bound on each pass.

The prefill obeys the backend's :class:`PrefillBudget` (``backend.prefill_budget``, set by
:class:`~calm_runtime.inference.lm.CalibratedLM` from ``max_prefill_tokens``): a batch whose
prefill would not fit one pass is cut into groups of rows (longest first, each group
left-padded to its own longest row; on a packed engine rows of one length per pass), a row
that does not fit alone is prefilled in pieces of positions on top of its own KV cache, and
the groups' caches are put back together in the callers' row order (``backend.assemble``)
before decoding. A prompt that cannot fit even alone is refused (:meth:`PrefillBudget.check`)
before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from calm_runtime.errors import ConfigError

__all__ = ["left_pad", "initial_positions", "PrefillBudget", "PrefillStopped", "prefill",
           "release", "released", "DEFAULT_MAX_PREFILL_TOKENS", "PREFILL_BYTES_PER_TOKEN",
           "ATTENTION_BUFFERS"]

#: ``max_prefill_tokens`` by default (``calm serve --max-prefill-tokens``): the most tokens
#: (rows x padded positions) one prefill pass takes, as vLLM's ``--max-num-batched-tokens``
DEFAULT_MAX_PREFILL_TOKENS = 4096
#: bytes of working set (attention scores and logits) a pass may hold per token of
#: ``max_prefill_tokens``: 256 MiB at the default
PREFILL_BYTES_PER_TOKEN = 64 << 10
#: float32 attention matrices (rows x heads x new x (past + new)) alive at once in a pass of a
#: graph that materialises them: one prefill of 1,024-3,100 tokens of calm's own graph on ONNX
#: Runtime's CPU provider grew the process by 4.6x one matrix without the memory arena and
#: 5.1-5.5x with it (its power-of-two regions round up)
ATTENTION_BUFFERS = 5
#: rows of a packed prefill whose lengths differ by at most this many tokens share a pass.
#: Measured (SmolLM2-135M, the default builder graph, 2 cores; 64 ARC-Easy cloze prompts of
#: 11-76 tokens, 31 lengths): one pass per length 2.39-2.68 s; spread 2: 15 passes,
#: 1.97-2.20 s; 4: 10 passes, 1.98-2.01 s; 8: 2.06 s; 16: 2.32-2.70 s; 64: 3.54-3.80 s (each
#: row projecting ever more positions)
PACKED_LENGTH_SPREAD = 4


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


def _largest(fits: Callable[[int], bool], high: int) -> int:
    """The largest ``n`` in ``1..high`` with ``fits(n)`` (``fits`` holds for all smaller ``n``
    when it holds for ``n``), or 0 when ``fits(1)`` fails."""
    low = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class PrefillBudget:
    """The bound on one forward pass over many positions (a prefill, a scoring segment).

    A pass of ``rows`` x ``new`` positions on top of ``past`` cached ones fits when

    * ``rows * new <= tokens`` (``max_prefill_tokens``), and
    * its working set, ``4 * rows * (ATTENTION_BUFFERS * heads * new * (past + new) +
      kept * vocab)`` bytes, is at most ``tokens * PREFILL_BYTES_PER_TOKEN``, where ``heads``
      is 0 for a graph that never holds the attention matrix (ONNX Runtime's
      ``GroupQueryAttention`` of the builder graph) and ``kept`` is 1 when the pass projects
      only the last position (``logits_to_keep``), else ``new``.

    ``chunked``: a row that does not fit alone may be prefilled in pieces on top of its own
    cache (every backend but TensorRT, whose plan takes one token at a time over a past).
    """

    tokens: int
    heads: int = 0
    vocab: int = 0
    #: a first pass (no past) / a pass on top of a cache projects only the last position
    #: (``"one-row"``: only when it has one row)
    last_logits: bool | str = True
    last_logits_with_past: bool | str = True
    chunked: bool = True
    #: a packed (``"one-row"``) pass keeps one count of last positions for all its rows,
    #: ``longest - shortest + 1``: rows whose lengths differ by at most this many tokens
    #: share a pass (fewer, larger passes), each projecting that many positions
    length_spread: int = 0

    @classmethod
    def for_backend(cls, backend, manifest, tokens: int) -> PrefillBudget:
        """The budget of ``tokens`` on ``backend`` running ``manifest``'s graph (what the
        backend declares: ``materializes_attention``, ``keeps_last_logits``,
        ``multi_token_with_past``)."""
        model = manifest.model
        heads = model.get("num_attention_heads") or max(
            model["num_kv_heads"], model["hidden_size"] // max(model["head_dim"], 1))
        first, with_past = getattr(backend, "keeps_last_logits", (False, False))
        return cls(tokens=int(tokens),
                   heads=int(heads) if getattr(backend, "materializes_attention", True) else 0,
                   vocab=int(manifest.vocab_size), last_logits=first,
                   last_logits_with_past=with_past,
                   chunked=bool(getattr(backend, "multi_token_with_past", True)),
                   length_spread=PACKED_LENGTH_SPREAD if first == "one-row" else 0)

    @property
    def bytes(self) -> int:
        """The working set one pass may hold."""
        return self.tokens * PREFILL_BYTES_PER_TOKEN

    def cost(self, rows: int, new: int, past: int = 0, *, all_logits: bool = False,
             one_length: bool = False, kept: int | None = None) -> int:
        """Bytes of attention scores and logits a pass of ``rows`` x ``new`` positions on top
        of ``past`` holds (``all_logits``: the logits of every position are asked for;
        ``one_length``: every row is ``new`` tokens long; ``kept``: the positions a packed
        pass of rows of several lengths projects)."""
        last = self.last_logits_with_past if past else self.last_logits
        if last == "one-row":  # one count of last positions for all rows (packed graph)
            last = rows == 1 or one_length
        if kept is None:
            kept = new if all_logits or not last else 1
        return 4 * rows * (ATTENTION_BUFFERS * self.heads * new * (past + new)
                           + kept * self.vocab)

    def fits(self, rows: int, new: int, past: int = 0, *, all_logits: bool = False,
             one_length: bool = False, kept: int | None = None) -> bool:
        return (rows * new <= self.tokens
                and self.cost(rows, new, past, all_logits=all_logits,
                              one_length=one_length, kept=kept) <= self.bytes)

    def span(self, rows: int, total: int, *, all_logits: bool = False) -> int:
        """The most positions per pass for ``rows`` rows fed in pieces on top of their cache
        up to ``total`` positions (every piece fits, the last one included); 0: none."""
        return _largest(lambda n: (self.fits(rows, n, 0, all_logits=all_logits)
                                   and self.fits(rows, n, max(0, total - n),
                                                 all_logits=all_logits)), max(1, total))

    def rows(self, new: int, total: int, *, all_logits: bool = False) -> int:
        """The most rows a pass of ``new`` positions up to ``total`` (past + new) takes."""
        return _largest(lambda r: self.fits(r, new, total - new, all_logits=all_logits),
                        max(1, self.tokens))

    def chunk(self, length: int) -> int:
        """Positions per prefill pass of one row of ``length`` tokens: ``length`` when it fits
        one pass, pieces when the backend can chunk, 0 when it cannot be prefilled."""
        if self.fits(1, length):
            return length
        return self.span(1, length) if self.chunked else 0

    def check(self, length: int, label: str = "the prompt",
              flag: str = "max_prefill_tokens") -> None:
        """Refuse (:class:`ConfigError`) a prompt of ``length`` tokens that cannot be prefilled
        even alone; ``flag`` is how the message names the setting."""
        if self.chunk(length) > 0:
            return
        if not self.chunked and length > self.tokens:
            why = (f"this engine's backend cannot prefill a prompt in pieces and takes at most "
                   f"{self.tokens} tokens in one pass ({flag} {self.tokens})")
        else:
            why = (f"even one position of it over {length} tokens needs more than the "
                   f"{self.bytes >> 20} MiB prefill budget of {flag} {self.tokens}")
        raise ConfigError(f"{label} is {length} tokens; {why}; shorten the prompt or raise "
                          f"{flag}")

    def plan(self, lengths: Sequence[int]) -> list[tuple[list[int], int]]:
        """The prefill passes of rows of ``lengths`` tokens: ``(rows, chunk)`` groups, all the
        rows in one group when they fit one pass (left-padded to the longest), else groups of
        rows by decreasing length that each fit one pass, and rows that fit no pass alone in
        pieces of ``chunk`` positions. Raises :class:`ConfigError` before any pass when a row
        cannot be prefilled (see :meth:`check`)."""
        n = len(lengths)
        for i, length in enumerate(lengths):
            self.check(length, "the prompt" if n == 1 else f"prompt {i + 1} of {n}")
        width = max(lengths)
        if self.last_logits == "one-row" and len(set(lengths)) > 1:
            # a packed pass keeps one count of last positions for all its rows: rows of
            # different lengths project every position from the shortest row's last on, so
            # rows go in groups whose lengths differ by at most ``length_spread``
            groups: list[list[int]] = []
            for i in sorted(range(n), key=lambda i: -lengths[i]):
                if groups:
                    rows, top = groups[-1], lengths[groups[-1][0]]
                    spread = top - lengths[i]
                    if spread <= self.length_spread and self.fits(
                            len(rows) + 1, top, kept=spread + 1, one_length=spread == 0):
                        rows.append(i)
                        continue
                groups.append([i])
            return [(rows, self.chunk(lengths[rows[0]])) for rows in groups]
        if self.fits(n, width):
            return [(list(range(n)), width)]
        order = sorted(range(n), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and self.fits(len(groups[-1]) + 1, lengths[groups[-1][0]]):
                groups[-1].append(i)
            else:
                groups.append([i])
        return [(rows, self.chunk(lengths[rows[0]])) for rows in groups]


def released(backend, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, then :func:`release`, also when it raises: its error is
    re-raised without the traceback of ``fn``'s frames, which would keep their KV states and
    passes alive (and their memory allocated) through the release."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the release
        error = exc.with_traceback(None)  # fn's frames go when this block ends
    release(backend)
    if error is not None:
        raise error
    return result


def release(backend) -> None:
    """``backend.release()`` where the backend has it (the end of a call: memory cached
    between its passes goes back to the system)."""
    fn = getattr(backend, "release", None)
    if fn is not None:
        fn()


class PrefillStopped(Exception):
    """``should_stop()`` answered true between two prefill passes (every row's caller gave
    up): nothing is left to compute for."""


def prefill(backend, prompts: Sequence[Sequence[int]], pad_id: int, *,
            keep_state: bool = True, should_stop: Callable[[], bool] | None = None,
            parts: bool = False) -> tuple[np.ndarray, object]:
    """The last position's logits ``[N, V]`` of each prompt and (``keep_state``) the KV state
    of the left-padded batch, run within ``backend.prefill_budget`` (see the module doc).
    ``should_stop()`` is asked between passes; true raises :class:`PrefillStopped`.
    ``parts``: the state as the ``(rows, state)`` parts of its passes, for a caller that
    assembles them with more (a running batch's cache: one copy instead of two)."""
    budget = getattr(backend, "prefill_budget", None)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    plan = ([(list(range(len(prompts))), width)] if budget is None
            else budget.plan(lengths))
    if len(plan) == 1 and plan[0][1] >= width:  # one pass, as always
        ids, mask = left_pad(prompts, pad_id)
        logits, state = backend.run(ids, mask, initial_positions(mask), None, last_only=True)
        if parts:
            return logits[:, -1], ([(np.arange(len(prompts), dtype=np.int64), state)]
                                   if keep_state else None)
        return logits[:, -1], (state if keep_state else None)
    last: list = [None] * len(prompts)
    pieces = []
    for rows, chunk in plan:
        ids, mask = left_pad([prompts[i] for i in rows], pad_id)
        positions = initial_positions(mask)
        state = None
        for start in range(0, ids.shape[1], chunk):
            if should_stop is not None and should_stop():
                raise PrefillStopped()
            end = min(ids.shape[1], start + chunk)
            logits, state = backend.run(ids[:, start:end], mask[:, :end],
                                        positions[:, start:end], state, last_only=True)
        for j, i in enumerate(rows):
            last[i] = logits[j, -1]
        if keep_state:
            pieces.append((np.asarray(rows, dtype=np.int64), state))
        del state
    logits = np.stack(last)
    if not keep_state:
        return logits, None
    if parts:
        return logits, pieces
    return logits, backend.assemble(pieces, len(prompts), width)
