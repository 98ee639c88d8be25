"""Open QA with a local model or engine: greedy answers to ``"Question: ...\nAnswer:"``
prompts and the two-way P(True) logits of judging prompts (docs/methods.md §2). The
served-model counterparts are in :mod:`.remote`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from calm_runtime.data.prompts import cloze_context
from calm_runtime.errors import ConfigError
from calm_runtime.modes import PTrueTemplate
from calm_runtime.progress import progress as progress_bar
from calm_training.scoring.engine import EngineModel
from calm_training.scoring.local import (
    batched_logits,
    context_limit,
    encode_within,
    left_pad,
    padding_id,
    single_token_id,
    token_batches,
    uses_chat_template,
)

__all__ = ["generate_answers", "score_p_true"]


def _engine_answers(model, tokenizer, prompts, max_new_tokens, batch_size, progress):
    """:func:`generate_answers` on an engine: greedy decoding with the runtime's KV loop."""
    answers = [""] * len(prompts)
    size = min(batch_size, model.backend.max_batch or batch_size)
    for start in progress_bar(range(0, len(prompts), size), desc="generating", unit="batch",
                              bar=progress):
        run = model.lm.generation_run(prompts[start:start + size], max_new_tokens)
        for _ in run:
            pass
        for offset, generation in enumerate(run.results):
            ids = [token.id for token in generation.tokens]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            answers[start + offset] = text.strip().split("\n")[0].strip()
    return answers


def score_p_true(model, tokenizer, questions: Sequence[str], answers: Sequence[str],
                 template: PTrueTemplate, *, chat: bool | None = None, batch_size: int = 16,
                 calibration=None, progress: bool = True,
                 max_length: int | None = None) -> np.ndarray:
    """Two-way logits ``[N, 2]`` (the true and false tokens' logits) for each pair.

    P(True) is ``softmax`` over the two columns (docs/methods.md §2).
    """
    if len(questions) != len(answers):
        raise ConfigError(f"{len(questions)} questions but {len(answers)} answers; pass one "
                          "answer per question")
    use_chat = uses_chat_template(tokenizer, chat)
    true_text = template.true_token.lstrip() if use_chat else template.true_token
    false_text = template.false_token.lstrip() if use_chat else template.false_token
    ids = [single_token_id(tokenizer, true_text), single_token_id(tokenizer, false_text)]
    limit = context_limit(model, max_length)
    prompts = [encode_within(tokenizer, template.render(q, a), limit,
                             f"P(True) prompt {i} ({q[:40]!r})", special=True, chat=use_chat)
               for i, (q, a) in enumerate(zip(questions, answers, strict=True))]
    out = np.zeros((len(prompts), 2))
    pad = padding_id(tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    for chunk in progress_bar(list(token_batches(order, batch_size, [len(p) for p in prompts])),
                              desc="P(True)", unit="batch", bar=progress):
        logits = batched_logits(model, [prompts[i] for i in chunk], 1, pad)
        if calibration is not None:
            logits = calibration.calibrate(logits)
        out[chunk] = logits[:, 0, ids].double().numpy()
    return out


def generate_answers(model, tokenizer, questions: Sequence[str], *, max_new_tokens: int = 24,
                     batch_size: int = 8, progress: bool = True,
                     max_length: int | None = None) -> list[str]:
    """Greedy answers to ``"Question: ...\\nAnswer:"`` prompts, cut at the first newline."""
    import torch

    pad = padding_id(tokenizer)
    answers: list[str] = [""] * len(questions)
    limit = context_limit(model, max_length)
    prompts = [encode_within(tokenizer, cloze_context(q), limit, f"question {i} ({q[:40]!r})",
                             special=True, reserve=max_new_tokens)
               for i, q in enumerate(questions)]
    if isinstance(model, EngineModel):
        return _engine_answers(model, tokenizer, prompts, max_new_tokens, batch_size, progress)
    for chunk in progress_bar(list(token_batches(list(range(len(prompts))), batch_size,
                                                 [len(p) for p in prompts])),
                              desc="generating", unit="batch", bar=progress):
        ids, mask, _ = left_pad([prompts[i] for i in chunk], pad)
        length = ids.shape[1]
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad)
        for b, i in enumerate(chunk):
            text = tokenizer.decode(out[b, length:], skip_special_tokens=True)
            answers[i] = text.strip().split("\n")[0].strip()
    return answers
