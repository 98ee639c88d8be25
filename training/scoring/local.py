"""Scoring multiple-choice and open-QA records with a causal LM (torch, batched).

Multiple choice (docs/methods.md §2):

* **cloze** — the log-probability of each option's text ``" {option}"`` as the
  continuation of ``"Question: ...\\nAnswer:"``; kept as the summed log-probability plus
  the token and character counts, so every scoring variant
  (:data:`calm_runtime.modes.CLOZE_VARIANTS`) is derived without recomputation;
* **letter** — the next-token logits of the option letters after a prompt listing the
  options (ids looked up in the model's own tokenizer, with or without its chat template).

Open QA: greedy answers, correctness by normalised alias match, and P(True) from named
templates. Sequences are left-padded with explicit position ids and only the needed
positions are projected through the LM head (``logits_to_keep``), so batching and padding
do not change a score (tested against an unbatched computation).

``model`` may also be an :class:`~calm_training.scoring.engine.EngineModel` (an exported
engine): the same token ids then run through ONNX Runtime with the runtime's scoring
passes (``calm_runtime.inference.scoring_passes``), and the scores equal the torch path's
to export parity.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import numpy as np

from calm_runtime import modes
from calm_runtime.data.prompts import (
    cloze_context,
    cloze_continuation,
    letter_prompt,
    letter_tokens,
    option_char_count,
)
from calm_runtime.data.sets import MultipleChoiceRecord
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.inference import scoring_passes
from calm_runtime.measure.score import is_correct, normalize_answer
from calm_runtime.progress import progress as progress_bar
from calm_training.scoring.engine import EngineModel
from calm_training.scoring.option_scores import OptionScores

__all__ = [
    "score_multiple_choice",
    "normalize_answer",
    "is_correct",
    "uses_chat_template",
]

logger = logging.getLogger(__name__)



def uses_chat_template(tokenizer, chat: bool | None) -> bool:
    """``chat=None`` means: use the chat template when the tokenizer has one."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has:
        raise ConfigError("the tokenizer has no chat template; pass chat=False (--no-chat)")
    return has if chat is None else bool(chat)


def render_chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


def encode_text(tokenizer, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


#: A token covers at most this many times the characters of the longest token string in the
#: vocabulary (a margin for normalisers that compose characters); text longer than
#: ``limit * factor * longest`` cannot fit ``limit`` tokens and is refused before tokenising.
CHARS_PER_TOKEN_MARGIN = 4
#: Scoring batches hold at most ``batch_size * BATCH_TOKENS_PER_ROW`` padded tokens: long
#: sequences run in smaller batches, so no batch's size is set by one long input.
BATCH_TOKENS_PER_ROW = 512


#: the longest token string of each tokenizer seen (a tokenizer is not ours to write on)
_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The longest token string of the vocabulary (computed once per tokenizer)."""
    try:
        return _MAX_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable: computed
        pass
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1) or 1
    try:
        _MAX_TOKEN_CHARS[tokenizer] = longest
    except TypeError:
        pass
    return longest


def context_limit(model, max_length: int | None = None) -> int:
    """Tokens a scored sequence may have: the model's context (``max_position_embeddings``)
    or ``max_length`` if that is smaller."""
    config = getattr(model, "config", None)
    context = getattr(config, "max_position_embeddings", None)
    limits = [v for v in (context, max_length) if isinstance(v, int) and v > 0]
    if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    return min(limits) if limits else 1 << 30


def encode_within(tokenizer, text: str, limit: int, what: str, *, special: bool,
                  reserve: int = 0, chat: bool = False) -> list[int]:
    """``text`` encoded, or a one-line :class:`DataError` naming ``what`` when it cannot fit
    ``limit - reserve`` tokens. Text that cannot fit by its length alone is refused before
    it is tokenised, so no allocation is ever sized by the input."""
    room = limit - reserve
    if len(text) > max(room, 1) * max_token_chars(tokenizer) * CHARS_PER_TOKEN_MARGIN:
        raise DataError(f"{what} is {len(text):,} characters, far more than the {limit}-token "
                        "context can hold; shorten or drop it")
    ids = (encode_text(tokenizer, render_chat(tokenizer, text), special=False) if chat
           else encode_text(tokenizer, text, special=special))
    if len(ids) > room:
        extra = f" plus {reserve} for the answer" if reserve else ""
        raise DataError(f"{what} is {len(ids):,} tokens{extra}, more than the {limit}-token "
                        "context (the model's, or --max-length); shorten or drop it")
    return ids


def describe(record, index: int) -> str:
    """How errors name a record: its position, its id and the start of its question."""
    ident = f", id {record.id!r}" if getattr(record, "id", None) else ""
    question = record.question[:40] + ("..." if len(record.question) > 40 else "")
    return f"record {index}{ident} ({question!r})"


def single_token_id(tokenizer, text: str) -> int:
    """The id of ``text`` as one token, or a clear error naming the tokenizer's split."""
    ids = encode_text(tokenizer, text, special=False)
    if len(ids) != 1:
        raise ConfigError(f"option token {text!r} is {len(ids)} tokens in this tokenizer "
                          f"({ids}); letter mode needs single-token letters, use cloze mode")
    return ids[0]


def padding_id(tokenizer) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int):
    """``(input_ids, attention_mask, position_ids)`` of left-padded ``sequences``: padding
    on the left, positions counting the real tokens only (0 on the padding)."""
    import torch

    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, length - len(seq):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def batched_logits(model, sequences: Sequence[Sequence[int]], keep: int, pad_id: int):
    """Float32 logits of the last ``keep`` positions of left-padded ``sequences`` [B, keep, V]."""
    import torch

    if isinstance(model, EngineModel):
        if keep != 1:
            raise ValueError("an engine scores the last position only here")
        logits = scoring_passes.next_token_logits(model.backend, sequences, pad_id, len(sequences))
        return torch.from_numpy(logits)[:, None]
    ids, mask, positions = left_pad(sequences, pad_id)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    logits_to_keep=keep, use_cache=False)
    return out.logits.float()


def token_batches(order: Sequence[int], batch_size: int, lengths: Sequence[int] | None = None,
             costs: Sequence[int] | None = None, cost_budget: int = 0):
    """Consecutive chunks of ``order`` with at most ``batch_size`` items and, given
    ``lengths``, at most ``batch_size * BATCH_TOKENS_PER_ROW`` padded tokens; given
    ``costs`` (bytes an item allocates), at most ``cost_budget`` bytes per chunk."""
    budget = batch_size * BATCH_TOKENS_PER_ROW
    chunk: list[int] = []
    longest = spent = 0
    for i in order:
        size = 0 if lengths is None else lengths[i]
        cost = 0 if costs is None else costs[i]
        if chunk and (len(chunk) == batch_size or max(longest, size) * (len(chunk) + 1) > budget
                      or (costs is not None and spent + cost > cost_budget)):
            yield chunk
            chunk, longest, spent = [], 0, 0
        chunk.append(i)
        longest = max(longest, size)
        spent += cost
    if chunk:
        yield chunk


#: Bytes per logit a scoring step holds at once: the float32 logits, their log-softmax and
#: the temporaries between them.
LOGIT_BYTES = 12
#: What one scoring step may allocate for logits: batches are sized by it (options x
#: positions x vocabulary), and a question whose options alone exceed it is scored option by
#: option, in position segments that fit it.
SCORING_BUDGET_BYTES = 256 << 20


def _vocab_size(model) -> int:
    if isinstance(model, EngineModel):
        return int(model.lm.manifest.vocab_size)
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def _cloze_in_segments(model, context: Sequence[int], cont: Sequence[int], calibration,
                       vocab: int) -> float:
    """One option's summed log-probability after its context, the option fed in segments of
    positions whose logits fit :data:`SCORING_BUDGET_BYTES` (the KV cache carries over)."""
    import torch

    segment = max(1, SCORING_BUDGET_BYTES // (vocab * LOGIT_BYTES))
    ids = torch.as_tensor([list(context)], dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                    logits_to_keep=1)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    previous = out.logits[:, -1:].float()
    total, seen = 0.0, len(context)
    fed = list(cont[:-1])
    targets = list(cont)
    for start in range(0, len(targets), segment):
        end = min(len(targets), start + segment)
        # logits predicting targets[start:end]: the previous step's last, then this segment's
        step = [previous]
        feed = fed[start:end - 1]
        if feed:
            piece = torch.as_tensor([feed], dtype=torch.long)
            with torch.inference_mode():
                out = model(input_ids=piece,
                            attention_mask=torch.ones((1, seen + len(feed)), dtype=torch.long),
                            position_ids=torch.arange(seen, seen + len(feed))[None],
                            use_cache=True, **{cache_kwarg(model): cache})
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            step.append(out.logits.float())
            seen += len(feed)
        logits = torch.cat(step, dim=1)
        if calibration is not None:
            logits = calibration.calibrate(logits)
        want = torch.as_tensor([targets[start:end]], dtype=torch.long)
        total += float(logits.log_softmax(-1).gather(-1, want[..., None]).double().sum())
        if end < len(targets):
            # the next segment starts from the prediction after the last fed token: feed it
            piece = torch.as_tensor([[targets[end - 1]]], dtype=torch.long)
            with torch.inference_mode():
                out = model(input_ids=piece,
                            attention_mask=torch.ones((1, seen + 1), dtype=torch.long),
                            position_ids=torch.tensor([[seen]]), use_cache=True,
                            **{cache_kwarg(model): cache})
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            previous = out.logits.float()
            seen += 1
    return total


def score_multiple_choice(model, tokenizer, records: Sequence[MultipleChoiceRecord], *,
                          mode: str = "cloze", batch_size: int = 8, chat: bool | None = None,
                          calibration=None, progress: bool = True,
                          max_length: int | None = None) -> OptionScores:
    """Option scores for ``records`` in ``mode`` (see the module docstring).

    ``calibration`` (a :class:`~calm_runtime.formats.artifact.CalibrationAdapter`) is applied to the
    full-vocabulary logits before anything is read from them, as an engine would. Every
    sequence must fit :func:`context_limit` (the model's context or ``max_length``); a
    record that does not is a :class:`DataError` naming it, raised before any batch runs.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    out = OptionScores.empty(records, mode)
    values, n_tokens, n_chars = out.values, out.n_tokens, out.n_chars
    pad = padding_id(tokenizer)
    limit = context_limit(model, max_length)
    was_training = model.training
    model.eval()
    try:
        if not modes.mode(mode).token_level:
            _score_cloze(model, tokenizer, records, values, n_tokens, n_chars, batch_size, pad,
                         calibration, progress, limit)
        else:
            out.option_ids = _score_letters(model, tokenizer, records, values, batch_size, pad,
                                            uses_chat_template(tokenizer, chat), calibration,
                                            progress, limit)
    finally:
        model.train(was_training)
    return out


def _score_cloze(model, tokenizer, records, values, n_tokens, n_chars, batch_size, pad,
                 calibration, progress, limit):
    """Score every option, running each question's context once and sharing its KV cache.

    A batch of left-padded contexts is run with the cache on; the cache rows are then
    repeated once per option, and the right-padded continuations run on top of them
    with position ids that continue each context. Padding never reaches a real token.
    """
    import torch

    contexts, continuations = [], []
    for row, record in enumerate(records):
        options = []
        for k, option in enumerate(record.choices):
            cont = encode_within(tokenizer, cloze_continuation(option), limit - 1,
                                 f"option {k} of {describe(record, row)}", special=False)
            if not cont:
                raise DataError(f"question {row} option {k} ({option!r}) tokenises to nothing; "
                                "fix or drop the option text")
            options.append(cont)
            n_tokens[row, k] = len(cont)
            n_chars[row, k] = option_char_count(option)
        continuations.append(options)
        longest = max(len(c) for c in options)
        contexts.append(encode_within(tokenizer, cloze_context(record.question), limit,
                                      describe(record, row), special=True, reserve=longest))
    order = sorted(range(len(records)), key=lambda i: -len(contexts[i]))
    lengths = [len(contexts[i]) + max(len(c) for c in continuations[i])
               for i in range(len(records))]
    # what a question's options allocate at once: [options, longest, V] logits (float32) and
    # their log-softmax; a question over the budget is scored option by option in segments
    vocab = _vocab_size(model)
    costs = [len(c) * max(len(o) for o in c) * vocab * LOGIT_BYTES for c in continuations]
    bar = progress_bar(total=len(records), desc="cloze scoring", unit="question", bar=progress)
    if not isinstance(model, EngineModel):
        large = [i for i in order if costs[i] > SCORING_BUDGET_BYTES]
        for i in large:
            for k, cont in enumerate(continuations[i]):
                values[i, k] = _cloze_in_segments(model, contexts[i], cont, calibration, vocab)
            bar.update(1)
        order = [i for i in order if costs[i] <= SCORING_BUDGET_BYTES]
    for chunk in token_batches(order, batch_size, lengths, costs, SCORING_BUDGET_BYTES):
        if isinstance(model, EngineModel):  # calibration: the engine's own, in its graph
            sums = scoring_passes.cloze_logprobs(model.backend, [contexts[i] for i in chunk],
                                           [continuations[i] for i in chunk], pad, len(chunk))
            for i, row_sums in zip(chunk, sums, strict=True):
                values[i, :len(row_sums)] = row_sums
            bar.update(len(chunk))
            continue
        first, cache, ctx_mask = _run_contexts(model, [contexts[i] for i in chunk], pad)
        owners = [b for b, i in enumerate(chunk) for _ in continuations[i]]
        conts = [c for i in chunk for c in continuations[i]]
        cache.batch_select_indices(torch.as_tensor(owners, dtype=torch.long))
        width = max(len(c) for c in conts)
        ids = torch.full((len(conts), width), pad, dtype=torch.long)
        cont_mask = torch.zeros_like(ids)
        for m, cont in enumerate(conts):
            ids[m, :len(cont)] = _long(cont)
            cont_mask[m, :len(cont)] = 1
        owner_idx = torch.as_tensor(owners, dtype=torch.long)
        mask = torch.cat([ctx_mask[owner_idx], cont_mask], dim=1)
        start = ctx_mask[owner_idx].sum(-1, keepdim=True)
        positions = start + torch.arange(width)[None, :]
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        use_cache=False, **{cache_kwarg(model): cache})
        step_logits = torch.cat([first[owner_idx][:, None, :], out.logits[:, :-1].float()], 1)
        if calibration is not None:
            step_logits = calibration.calibrate(step_logits)
        logp = step_logits.log_softmax(dim=-1).gather(-1, ids[:, :, None]).squeeze(-1)
        logp = (logp.double() * cont_mask).sum(-1).numpy()
        m = 0
        for i in chunk:
            for k in range(len(continuations[i])):
                values[i, k] = logp[m]
                m += 1
        bar.update(len(chunk))
    bar.close()


def cache_kwarg(model) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; accept both."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"


def _run_contexts(model, sequences, pad):
    """Run left-padded contexts with the KV cache on: last-position logits, cache, mask."""
    import torch

    ids, mask, positions = left_pad(sequences, pad)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.logits[:, -1].float(), cache, mask


def _score_letters(model, tokenizer, records, values, batch_size, pad, chat, calibration,
                   progress, limit):
    prompts = [encode_within(tokenizer, letter_prompt(record.question, record.choices), limit,
                             describe(record, row), special=True, chat=chat)
               for row, record in enumerate(records)]
    # option i of every question is letter i: the first k of the K_max letters' ids
    option_ids = [single_token_id(tokenizer, t) for t in letter_tokens(values.shape[1], chat=chat)]
    order = sorted(range(len(records)), key=lambda i: -len(prompts[i]))
    bar = progress_bar(total=len(records), desc="letter scoring", unit="question",
                       bar=progress)
    for chunk in token_batches(order, batch_size, [len(p) for p in prompts]):
        logits = batched_logits(model, [prompts[i] for i in chunk], 1, pad)
        if calibration is not None:
            logits = calibration.calibrate(logits)
        for b, row in enumerate(chunk):
            ids = option_ids[:len(records[row].choices)]
            # raw logits (not log-softmax): vector scaling acts on logits, and only then
            # maps exactly onto tau/shift of the option tokens (docs/methods.md §1)
            values[row, :len(ids)] = logits[b, 0, ids].double().numpy()
        bar.update(len(chunk))
    bar.close()
    return np.asarray(option_ids, dtype=np.int64)


def _long(ids):
    import torch

    return torch.as_tensor(ids, dtype=torch.long)
