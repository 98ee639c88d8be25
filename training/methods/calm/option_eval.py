"""Option probabilities of one model under many LoRA and α settings, cheaply.

Evaluating CALM means scoring the same questions with the LoRA and α of several arms, with
and without α, and the base model with an arm's α. The decoder's hidden states do not
depend on α, so :class:`OptionEvaluator` runs the decoder once per LoRA (:meth:`hidden`)
and then, for any ``(tau, shift)``, only the LM head, the calibration formula and the
option scores (:meth:`scores`) — the same code path (:func:`~calm_training.methods.calm.model.
option_scores`) the options entropy of training uses, and equal to
:func:`calm_training.scoring.local.score_multiple_choice` with the adapter applied (tested).

Cloze mode scores every option's text after ``"Question: ...\\nAnswer:"`` with the chosen
variant; letter mode reads the option letters at the answer position. The evaluator also
returns the full-vocabulary entropy at the answer position (where the answer starts): the
quantity that shows whether a model learned to flatten its own output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import DataError
from calm_runtime.modes import DEFAULT_CLOZE_VARIANT
from calm_training.methods.calm import data as calm_data

__all__ = ["HiddenSet", "OptionEvaluator"]


@dataclass
class HiddenSet:
    """Hidden states at the scoring positions of a set of questions, per batch."""

    batches: list  # [(TokenBatch, hidden [P, d], answer rows [E])]
    labels: np.ndarray  # [N], -1 where unlabeled
    k_max: int


def _context_length(example) -> int:
    """Tokens before the first scored position of a cloze option example (its context)."""
    return example.positions[0][1] + 1


def _shares_context(example) -> bool:
    """Whether every option sequence starts with the same context (not cut differently)."""
    n = _context_length(example)
    firsts = {}
    for s, index in example.positions:
        firsts.setdefault(s, index)
    return all(i + 1 == n and example.sequences[s][:n] == example.sequences[0][:n]
               for s, i in firsts.items())


class OptionEvaluator:
    """Scores questions with a :class:`~calm_training.methods.calm.model.CalmModel` (base + LoRA).

    Set θ with ``model.load_lora(folder)`` or :meth:`reset_lora` (the base model), then call
    :meth:`hidden`; :meth:`scores` applies any ``(tau, shift)`` to those hidden states.
    """

    def __init__(self, model, *, mode: str = "cloze", variant: str = DEFAULT_CLOZE_VARIANT,
                 chat: bool = False, max_length: int = 256, batch_size: int = 16) -> None:
        self.model, self.batch_size = model, batch_size
        self.encoder = calm_data.Encoder(model.tokenizer, mode=mode, chat=chat,
                                          max_length=max_length, entropy="options",
                                          variant=variant)
        from calm_training.scoring.local import padding_id

        self.pad = padding_id(model.tokenizer)

    def reset_lora(self) -> None:
        """θ = 0: LoRA's update ``B A x`` vanishes and the model is the base model."""
        import torch

        with torch.no_grad():
            for p in self.model.theta:
                p.zero_()

    def hidden(self, records: Sequence[MultipleChoiceRecord], progress: bool = False
               ) -> HiddenSet:
        """Hidden states at every scoring position of ``records`` under the current θ.

        Cloze mode runs each question's context once and its options on top of the shared
        KV cache, as :func:`calm_training.scoring.local.score_multiple_choice` does.
        """
        from tqdm.auto import tqdm

        if not records:
            raise DataError("no records to evaluate; check the data and its limit")
        examples = [self.encoder.option_example(r) for r in records]
        batches = []
        for start in tqdm(range(0, len(examples), self.batch_size), desc="hidden states",
                          disable=not progress):
            chunk = examples[start:start + self.batch_size]
            batch = calm_data.collate(chunk, len(chunk), self.pad)
            batches.append(self._hidden_batch(chunk, batch))
        labels = np.array([-1 if r.answer is None else r.answer for r in records])
        return HiddenSet(batches, labels, max(len(r.choices) for r in records))

    def _hidden_batch(self, chunk, batch):
        import torch

        from calm_training.scoring.local import cache_kwarg, left_pad

        answer_rows, offset = [], 0
        for e in chunk:
            answer_rows.append(offset)  # the first position of option 0: the answer start
            offset += len(e.positions)
        answer_rows = torch.as_tensor(answer_rows, dtype=torch.long)
        decoder = self.model.lm.get_decoder()
        shared = not self.encoder.letters and all(_shares_context(e) for e in chunk)
        with torch.no_grad():
            if not shared:
                h = self.model.head.hidden(batch.input_ids, batch.attention_mask,
                                           batch.flat_positions)
                return batch, h, answer_rows
            contexts = [e.sequences[0][:_context_length(e)] for e in chunk]
            ids, mask, positions = left_pad(contexts, self.pad)
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions,
                          use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            last = out.last_hidden_state[:, -1]
            owners = [b for b, e in enumerate(chunk) for _ in e.sequences]
            conts = [seq[len(contexts[b]):] for b, e in enumerate(chunk) for seq in e.sequences]
            owner_idx = torch.as_tensor(owners, dtype=torch.long)
            cache.batch_select_indices(owner_idx)
            width = max(max(len(c) for c in conts) - 1, 1)
            cont_ids = torch.full((len(conts), width), self.pad, dtype=torch.long)
            cont_mask = torch.zeros_like(cont_ids)
            for m, cont in enumerate(conts):
                if len(cont) > 1:
                    cont_ids[m, :len(cont) - 1] = torch.as_tensor(cont[:-1])
                    cont_mask[m, :len(cont) - 1] = 1
            full_mask = torch.cat([mask[owner_idx], cont_mask], dim=1)
            start = mask[owner_idx].sum(-1, keepdim=True)
            cont_out = decoder(input_ids=cont_ids, attention_mask=full_mask,
                               position_ids=start + torch.arange(width)[None, :],
                               use_cache=False, **{cache_kwarg(decoder): cache})
            rows, m = [], 0
            for b, e in enumerate(chunk):
                for cont in e.sequences:
                    n = len(cont) - len(contexts[b])
                    rows.append(last[b:b + 1])
                    rows.append(cont_out.last_hidden_state[m, :n - 1])
                    m += 1
            h = torch.cat(rows)
        return batch, h, answer_rows

    def scores(self, hidden: HiddenSet, tau=None, shift=None, *, center: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
        """``(option scores [N, k_max] (-inf where absent), answer-position entropy [N])``
        with the calibration ``z / tau + shift`` (``None``: identity; ``z`` centred first
        with ``center``) applied."""
        import torch

        from calm_runtime.calibration import apply_calibration
        from calm_training.methods.calm.model import option_scores

        tau_t = None if tau is None else torch.as_tensor(np.asarray(tau, np.float32))
        shift_t = None if shift is None else torch.as_tensor(np.asarray(shift, np.float32))
        out, entropy = [], []
        with torch.no_grad():
            for batch, h, answer_rows in hidden.batches:
                logp = apply_calibration(self.model.head.project(h), tau_t, shift_t,
                                         center=center).log_softmax(-1)
                s = option_scores(logp, batch).double()
                pad = torch.full((s.shape[0], hidden.k_max), float("-inf"), dtype=s.dtype)
                pad[:, :s.shape[1]] = s
                out.append(pad.numpy())
                a = logp[answer_rows]
                entropy.append((-(a.exp() * a).sum(-1)).double().numpy())
        return np.concatenate(out), np.concatenate(entropy)
