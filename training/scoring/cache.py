"""On-disk cache of option scores, keyed by the model's, the adapter's and the data's hashes.

Scoring a data set with a model is the slow step of every fit and evaluation; its result
depends only on the model weights (and LoRA / calibration adapter), the records, the mode
and the prompt settings. The cache stores safetensors files under ``cache_dir("scores")``,
so reruns and later stages (``calm eval``, benchmarks) never recompute them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from calm_runtime import modes
from calm_runtime.data.sets import MultipleChoiceRecord, dataset_hash
from calm_runtime.files import sha256_bytes, sha256_file
from calm_runtime.formats.artifact import MANIFEST_NAME, CalibrationAdapter
from calm_runtime.paths import cache_dir
from calm_training.scoring.local import score_multiple_choice
from calm_training.scoring.option_scores import OptionScores
from calm_training.scoring.sources import ModelSource, as_source

__all__ = ["SCORER_VERSION", "cached_option_scores", "adapter_fingerprint"]

logger = logging.getLogger(__name__)

#: bump when the scoring code changes what it computes (invalidates cached scores)
SCORER_VERSION = 2  # 2: letter scores carry their option token ids


def adapter_fingerprint(adapter_dir: str | os.PathLike | None) -> str | None:
    """sha256 over an adapter's manifest, tensors and LoRA files (None without adapter)."""
    if adapter_dir is None:
        return None
    root = Path(adapter_dir)
    parts = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.name in (MANIFEST_NAME,):
            continue  # provenance and metrics do not change the scores
        parts.append(f"{path.relative_to(root)}:{sha256_file(path)}")
    return sha256_bytes("\n".join(parts).encode())


def cached_option_scores(model: ModelSource | str, records: Sequence[MultipleChoiceRecord], *,
                         mode: modes.Mode | str, adapter_dir: str | os.PathLike | None = None,
                         chat: bool | None = None, batch_size: int = 8,
                         progress: bool = True, loaded=None,
                         max_length: int | None = None) -> OptionScores:
    """Option scores of ``records`` by ``model`` (+ adapter), from the cache when possible.

    ``model`` is a :class:`~calm_training.scoring.sources.ModelSource`, or a spec or connected
    endpoint that :func:`~calm_training.scoring.sources.as_source` resolves.

    ``loaded`` may pass an already loaded ``(model, tokenizer)`` for the same spec and
    adapter, to avoid reloading when several data sets are scored in one run.
    """
    from safetensors.numpy import load_file, save_file

    source = as_source(model)
    source.check_adapter(adapter_dir)
    # letter prompts through the chat template or not: the source's one rule, which the
    # plan records as the prompt format and a vector fit reads its option tokens by
    mode = modes.mode(mode, choice=True)  # resolved once; the object travels from here
    use_chat = mode.chat_prompts and source.chat(chat)
    if source.served:  # a served model: its own per-request cache
        from calm_training.scoring.served import remote_option_scores

        if use_chat:
            logger.info("letter prompts go to %s as chat messages (/v1/chat/completions, the "
                        "served chat template); --no-chat sends them as text",
                        source.endpoint.base_url)
        scores, stats = remote_option_scores(source.endpoint, records, mode=mode,
                                             progress=progress, chat=use_chat)
        scores.floored = stats.floored
        return scores
    adapter = CalibrationAdapter.from_pretrained(adapter_dir) if adapter_dir else None
    # an adapter that changes no score (no LoRA, an identity head: a cloze answer temperature
    # alone) scores as the model does: its scores are the model's, cached once for both
    changes = adapter is not None and (adapter.lora_path is not None
                                       or adapter.has_token_calibration())
    key_material = {"scorer": SCORER_VERSION, "model": source.fingerprint(),
                    "adapter": adapter_fingerprint(adapter_dir) if changes else None,
                    "data": dataset_hash(records), "mode": mode.name, "chat": chat}
    key = sha256_bytes(json.dumps(key_material, sort_keys=True).encode())
    path = cache_dir("scores") / f"{mode.name}-{key[:40]}.safetensors"
    if path.is_file():
        try:
            scores = OptionScores.from_arrays(mode.name, load_file(str(path)))
            logger.info("scores for %s on %d records (%s) from cache %s", source.spec,
                        len(records), mode.name, path.name)
            return scores
        except Exception as exc:  # noqa: BLE001 - a broken cache entry is recomputed
            logger.warning("ignoring unreadable score cache %s (%s)", path, exc)
    if loaded is None:
        lm, tokenizer, identity = source.load(lora_path=adapter.lora_path if adapter else None)
        if adapter is not None:
            adapter.base_model.check_compatible(identity)
    else:
        lm, tokenizer = loaded
    calibration = adapter if adapter is not None and adapter.has_token_calibration() else None
    scores = score_multiple_choice(lm, tokenizer, records, mode=mode.name, batch_size=batch_size,
                                   chat=use_chat, calibration=calibration, progress=progress,
                                   max_length=max_length)
    handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    try:
        save_file(scores.to_arrays(), tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return scores
