"""The KV cache of a packed graph: rows packed to the left, one buffer read and written in place.

A *packed* engine (``export.graph.kind == "genai-builder"``, docs/formats.md) has no
``position_ids`` input: its attention (ONNX Runtime's ``GroupQueryAttention``) places row
``b``'s new tokens at cache slots ``seqlens[b] + 1 - S .. seqlens[b]`` with
``seqlens = attention_mask.sum(-1) - 1`` and derives their rotary positions from the same
count. So a row's tokens must sit at the start of its cache (right padding), and the cache
can be one buffer per layer that the graph reads as its past and writes as its present (the
kernel's shared-buffer mode: a decode step copies nothing; ``Concat``-based graphs copy the
whole cache every step).

The runtime's contract stays the standard one (left-padded ``input_ids``,
``attention_mask``, explicit ``position_ids``). :class:`PackedCache` translates:

* prefill (no cache): each row's real tokens are moved to the start of the row, the graph
  runs, and the logits are moved back to the caller's columns;
* later passes: every fed token takes the next slot of its row; the given ``position_ids``
  of real tokens must equal those slots (they do for the runtime's decode and scoring
  loops, and a call that breaks this is refused instead of computing something else), and
  a row's padding may only trail its real tokens (after padding, a row takes no more real
  tokens: the padding occupies slots the graph would attend to). The kernel takes several
  new tokens over a past for one row only, so a batch is fed one token at a time there.

The buffers grow by doubling (one copy), so decoding N tokens copies O(N) in total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["PackedCache", "PackedState", "pack_rows", "unpack_logits"]

#: slots a cache gets beyond the prompt at prefill (then it doubles as needed)
_HEADROOM = 128


_AFTER_PADDING = ("a packed engine's rows take padding only after their last real token; "
                  "this call feeds a real token after padding")
_NOT_NEXT_SLOT = ("a packed engine places each new token at its row's next cache slot; the "
                  "position_ids of this call differ from those slots")
#: ``real`` of one row's one real token (advance keeps the row's padded flag as it is)
_ONE_REAL = np.ones((1, 1), dtype=bool)
_ONE_REAL.setflags(write=False)


@dataclass
class PackedState:
    """One call's cache: ``[B, kv_heads, capacity, head_dim]`` buffers (host numpy arrays
    wrapped as ``OrtValue``s, or device ``OrtValue``s), each row's used slots, and whether a
    row has written padding into its cache (then it may take no more real tokens)."""

    arrays: list  # numpy arrays on the host, None on a GPU
    values: list  # the OrtValues bound as both past and present
    lengths: np.ndarray  # int64 [B]
    padded: np.ndarray  # bool [B]
    #: a one-token step's IO binding with these buffers bound (reused by the next steps:
    #: only the token ids, the mask and the logits' array are bound again)
    step: object | None = None
    #: host buffers with room for more rows, whose first ``B`` rows ``arrays`` are (None:
    #: ``arrays`` are whole buffers): rows that join a running batch are written into the
    #: spare rows, rows that leave are replaced by the last ones (:meth:`PackedCache.append`,
    #: :meth:`PackedCache.compact`), so neither copies the whole cache
    base: list | None = None

    @property
    def capacity(self) -> int:
        return int(self.values[0].shape()[2])


def pack_rows(input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
              pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """A prefill's rows with their real tokens moved to the start: ``(ids, mask, lengths,
    columns)`` where ``columns[b]`` are the caller's columns of row ``b``'s real tokens."""
    batch, seq = input_ids.shape
    ids = np.full((batch, seq), pad_id, dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    lengths = np.zeros(batch, dtype=np.int64)
    columns = []
    for b in range(batch):
        where = np.flatnonzero(attention_mask[b, -seq:] != 0)
        if where.size == 0:
            raise ValueError(f"row {b} of the prompt batch has no tokens")
        if not np.array_equal(position_ids[b, where], np.arange(where.size)):
            raise ValueError("a packed engine numbers each row's tokens from 0 in order; the "
                             f"position_ids of row {b} differ")
        ids[b, :where.size] = input_ids[b, where]
        mask[b, :where.size] = 1
        lengths[b] = where.size
        columns.append(where)
    return ids, mask, lengths, columns


class PackedCache:
    """The packed cache's buffers and bookkeeping for
    :class:`~calm_runtime.inference.backends.OnnxRuntimeBackend` (which runs the session):
    states from a prefill's outputs, growth, row selection, and each later pass's mask and
    checks."""

    def __init__(self, ort, kv_shape: tuple[int, int], kv_dtype, device: str,
                 device_id: int) -> None:
        self._ort = ort
        self._heads, self._dim = kv_shape
        self._dtype = kv_dtype
        self._device = device
        self._device_id = device_id

    # ------------------------------------------------------------------ buffers
    def _wrap(self, array: np.ndarray):
        if self._device == "cpu":
            return self._ort.OrtValue.ortvalue_from_numpy(array)
        return self._ort.OrtValue.ortvalue_from_numpy(array, self._device, self._device_id)

    def _new_state(self, host: list[np.ndarray], lengths, padded) -> PackedState:
        values = [self._wrap(a) for a in host]
        return PackedState(host if self._device == "cpu" else None, values,
                           np.asarray(lengths, dtype=np.int64), np.asarray(padded, dtype=bool))

    def _host(self, state: PackedState) -> list[np.ndarray]:
        return state.arrays if state.arrays is not None else [v.numpy() for v in state.values]

    def _views(self, base: list[np.ndarray], lengths, padded) -> PackedState:
        """A state over the first ``len(lengths)`` rows of the host buffers ``base``."""
        state = self._new_state([b[:len(lengths)] for b in base], lengths, padded)
        state.base = base
        return state

    def from_present(self, present, lengths: np.ndarray) -> PackedState:
        """A state holding a prefill's ``present`` outputs (width = the prompt's)."""
        arrays = [v if isinstance(v, np.ndarray) else v.numpy() for v in present]
        batch, width = arrays[0].shape[0], arrays[0].shape[2]
        capacity = width + max(_HEADROOM, width // 2)
        host = []
        for array in arrays:
            buffer = np.zeros((batch, self._heads, capacity, self._dim), self._dtype)
            buffer[:, :, :width] = array
            host.append(buffer)
        return self._new_state(host, lengths, np.zeros(batch, dtype=bool))

    def grown(self, state: PackedState, needed: int) -> PackedState:
        """``state`` with room for ``needed`` slots (doubling; the old buffers are copied)."""
        if needed <= state.capacity:
            return state
        capacity = max(needed, 2 * state.capacity)
        if state.arrays is not None:  # keep the spare rows
            base = state.base or state.arrays
            batch = len(state.lengths)
            grown = []
            for array in base:
                buffer = np.zeros(array.shape[:2] + (capacity, array.shape[3]), array.dtype)
                buffer[:batch, :, :array.shape[2]] = array[:batch]
                grown.append(buffer)
            return self._views(grown, state.lengths, state.padded)
        host = []
        for array in self._host(state):
            buffer = np.zeros(array.shape[:2] + (capacity, array.shape[3]), array.dtype)
            buffer[:, :, :array.shape[2]] = array
            host.append(buffer)
        return self._new_state(host, state.lengths, state.padded)

    def assemble(self, parts, batch: int) -> PackedState:
        """One state of ``batch`` rows from ``(rows, state)`` parts prefilled apart (row ``j``
        of a part's state becomes row ``rows[j]``; rows sit at the start of their cache, so
        no realignment is needed, only the largest capacity)."""
        hosts = [(np.asarray(rows, dtype=np.int64), self._host(state), state)
                 for rows, state in parts]
        capacity = max(state.capacity for _, _, state in hosts)
        lengths = np.zeros(batch, dtype=np.int64)
        padded = np.zeros(batch, dtype=bool)
        host = []
        for layer in range(len(hosts[0][1])):
            first = hosts[0][1][layer]
            buffer = np.zeros((batch, first.shape[1], capacity, first.shape[3]), first.dtype)
            for rows, arrays, state in hosts:
                # only the used slots, one row at a time: a scattered copy of whole parts
                # (headroom included) took 2.2 s of a 64-prompt admission's 4.5 s
                used = int(state.lengths.max())
                source = arrays[layer]
                for j, row in enumerate(rows.tolist()):
                    buffer[row, :, :used] = source[j, :, :used]
            host.append(buffer)
        for rows, _, state in hosts:
            lengths[rows] = state.lengths
            padded[rows] = state.padded
        return self._new_state(host, lengths, padded)

    def select(self, state: PackedState, rows: np.ndarray) -> PackedState:
        host = [np.ascontiguousarray(a[rows]) for a in self._host(state)]
        return self._new_state(host, state.lengths[rows], state.padded[rows])

    def compact(self, state: PackedState, order: np.ndarray) -> PackedState:
        """:meth:`select` of ``order`` that overwrites ``state``'s own buffers (``state`` is
        not valid afterwards): row ``i`` takes row ``order[i]``, copying only the rows that
        move. Needs ``order[i] >= i`` and no row twice (rows that leave replaced by later
        ones); anything else is a :meth:`select`."""
        order = np.asarray(order, dtype=np.int64)
        if (state.arrays is None or np.any(order < np.arange(order.size))
                or np.unique(order).size != order.size):
            return self.select(state, order)
        base = state.base or state.arrays
        moves = [(i, int(j)) for i, j in enumerate(order) if i != j]
        for array in base:
            for i, j in moves:
                array[i] = array[j]
        return self._views(base, state.lengths[order], state.padded[order])

    def append(self, state: PackedState, parts: list, total: int) -> PackedState:
        """``state``'s rows as rows ``0..B-1`` of ``total``, the others from ``parts``
        (``(rows, state)`` prefilled apart, ``rows`` from ``B`` on): written into ``state``'s
        spare rows (twice the rows are allocated, and its old rows copied once, when there are
        too few or they are too short)."""
        batch, added = len(state.lengths), total - len(state.lengths)
        base = state.base or state.arrays
        rows, capacity = base[0].shape[0], base[0].shape[2]
        width = max(int(part.lengths.max()) for _, part in parts)
        if rows < batch + added or capacity < width + 1:
            # twice the rows: the pages of rows never used are never touched (np.zeros),
            # and a batch that keeps growing copies its cache O(log rows) times
            rows = max(rows, 2 * (batch + added))
            capacity = max(capacity, width + _HEADROOM)
            grown = []
            for array in base:
                buffer = np.zeros((rows,) + array.shape[1:2] + (capacity, array.shape[3]),
                                  array.dtype)
                buffer[:batch, :, :array.shape[2]] = array[:batch]
                grown.append(buffer)
            base = grown
        lengths = np.concatenate([state.lengths, np.zeros(added, np.int64)])
        padded = np.concatenate([state.padded, np.zeros(added, bool)])
        for where, part in parts:
            used = int(part.lengths.max())
            for array, values in zip(base, self._host(part), strict=True):
                array[where, :, :used] = values[:, :, :used]
            lengths[where], padded[where] = part.lengths, part.padded
        return self._views(base, lengths, padded)

    # ------------------------------------------------------------------ passes
    def step_inputs(self, state: PackedState, attention_mask: np.ndarray,
                    position_ids: np.ndarray, seq: int) -> tuple[np.ndarray, np.ndarray]:
        """The mask the graph needs for ``seq`` new tokens per row (each row's used slots +
        ``seq``), after checking that the caller's positions are those slots; returns
        ``(mask, real)`` with ``real`` the caller's real tokens ``[B, seq]``."""
        if attention_mask.shape[0] == 1 and seq == 1 and attention_mask[0, -1] != 0:
            # one row's decode step, the latency path: the same checks on scalars (numpy's
            # per-call cost is a decode step's cost here)
            length = int(state.lengths[0])
            if state.padded[0]:
                raise ValueError(_AFTER_PADDING)
            if int(position_ids[0, -1]) != length:
                raise ValueError(_NOT_NEXT_SLOT)
            return np.ones((1, length + 1), np.int64), _ONE_REAL
        real = attention_mask[:, -seq:] != 0
        if np.any(real[:, 1:] & ~real[:, :-1]) or np.any(state.padded & real.any(axis=1)):
            raise ValueError(_AFTER_PADDING)
        slots = state.lengths[:, None] + np.arange(seq)[None, :]
        if np.any(real & (position_ids != slots)):
            raise ValueError(_NOT_NEXT_SLOT)
        total = state.lengths + seq
        width = int(total.max())
        mask = (np.arange(width)[None, :] < total[:, None]).astype(np.int64)
        return mask, real

    @staticmethod
    def advance(state: PackedState, real: np.ndarray, seq: int) -> PackedState:
        """The state after a pass: the same buffers (written in place beyond the old
        lengths, so ``state`` itself stays valid), each row ``seq`` slots longer."""
        padded = state.padded if real is _ONE_REAL else state.padded | ~real.all(axis=1)
        return PackedState(state.arrays, state.values, state.lengths + seq, padded, state.step,
                           state.base)


def unpack_logits(logits: np.ndarray, columns: list[np.ndarray], seq: int) -> np.ndarray:
    """Packed prefill logits ``[B, seq, V]`` back in the caller's columns (zeros on padding)."""
    out = np.zeros_like(logits)
    for b, where in enumerate(columns):
        out[b, where] = logits[b, :where.size]
    return out
