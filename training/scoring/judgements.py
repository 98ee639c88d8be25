"""Open-QA judgements: the model's greedy answers, their correctness by alias match, and
each model's two-way ``[true, false]`` P(True) logits (docs/methods.md §2), from a local
model or engine (``answers``) or through served endpoints (``served``), cached on disk.
What P(True)'s fits read (calm_training.posthoc.p_true, through ``FitPlan.judgements``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import p_true_template
from calm_runtime.data.sets import dataset_hash
from calm_runtime.errors import ConfigError
from calm_runtime.files import sha256_bytes
from calm_runtime.paths import cache_dir
from calm_training.scoring.answers import generate_answers, score_p_true
from calm_training.scoring.local import is_correct
from calm_training.scoring.served import remote_answers, remote_p_true

__all__ = ["ANSWER_VERSION", "open_qa_judgements"]

logger = logging.getLogger(__name__)

ANSWER_VERSION = 1  # bump when generation or judging changes (invalidates the cache)


def _cache_path(kind: str, material: dict) -> Path:
    key = sha256_bytes(json.dumps(material, sort_keys=True).encode())[:40]
    return cache_dir("scores") / f"{kind}-{key}.json"


def _load_or(path: Path, compute):
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            logger.warning("ignoring unreadable cache entry %s", path)
    value = compute()
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump(value, out)
    os.replace(tmp, path)
    return value


def open_qa_judgements(records, model, reference=None, *, template, chat: bool | None,
                       batch_size: int = 8, max_length: int | None = None,
                       progress: bool = True) -> dict:
    """The model's greedy answers to open-QA ``records``, their correctness, and each
    model's two-way P(True) logits under ``template`` (a name or a
    :class:`~calm_runtime.modes.PTrueTemplate`; ``model`` and
    ``reference``: :class:`~calm_training.scoring.sources.ModelSource` objects; cached on
    disk by the models', the data's and the template's hashes)."""
    template = p_true_template(template)
    sources = {"polm": model}
    if reference is not None:
        sources["plm"] = reference
    if any(s.served for s in sources.values()):
        return _remote_judgements(sources, records, template, chat=chat, progress=progress)
    base = {"version": ANSWER_VERSION, "data": dataset_hash(records),
            "polm": sources["polm"].fingerprint()}
    loaded = {}

    def loaded_model(source):
        if source.spec not in loaded:
            loaded[source.spec] = source.load()[:2]
        return loaded[source.spec]

    answers = _load_or(_cache_path("answers", base), lambda: generate_answers(
        *loaded_model(sources["polm"]), [r.question for r in records], progress=progress,
        max_length=max_length))
    correct = [is_correct(a, r.answers) for a, r in zip(answers, records, strict=True)]
    out = {"records": records, "answers": answers, "correct": np.array(correct, dtype=float)}
    for role, source in sources.items():
        material = {**base, "judge": source.fingerprint(),
                    "template": template.to_dict(), "chat": chat}
        logits = _load_or(_cache_path("ptrue", material), lambda source=source: score_p_true(
            *loaded_model(source), [r.question for r in records], answers, template,
            chat=source.chat(chat), batch_size=batch_size, progress=progress,
            max_length=max_length).tolist())
        out[role] = np.asarray(logits, dtype=float)
    return out


def _remote_judgements(sources: dict, records, template, *, chat: bool | None,
                       progress: bool) -> dict:
    """:func:`open_qa_judgements` when the model (and the reference) are served: both
    through their endpoints (each request cached by the remote scorer)."""
    if not all(s.served for s in sources.values()):
        raise ConfigError("P(True) with a served model needs a served reference too (or "
                          "none); pass both as endpoint URLs")
    questions = [r.question for r in records]
    polm = sources["polm"]
    answers = remote_answers(polm.endpoint, questions, progress=progress)
    correct = [is_correct(a, r.answers) for a, r in zip(answers, records, strict=True)]
    out = {"records": records, "answers": answers, "correct": np.array(correct, dtype=float),
           "floored": {}}
    for role, source in sources.items():
        out[role], stats = remote_p_true(source.endpoint, questions, answers, template,
                                         progress=progress, chat=source.chat(chat))
        out["floored"]["model" if role == "polm" else "reference"] = stats.floored
    return out
