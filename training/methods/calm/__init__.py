"""``calm train``'s methods (docs/methods.md §4), one folder: CALM's bilevel method and its
ablations, plain LoRA and CFT, and everything they train and write.

What the rest of calm and the benchmarks use is named here and imported from here (``from
calm_training.methods.calm import CalmConfig, train_calm``); the modules are this folder's
own, and no module outside it imports them, except the registry, which lists the methods
(:mod:`~calm_training.methods.calm.method`). The names load their module when first used, so
importing the registry imports neither torch nor the trainer.

The folder: the methods, their outer steps and the upper objectives (``method``, torch-free);
the settings (``config``); LoRA θ and α (``model``); the data (``data``); the steps
themselves (``bilevel``); the run (``trainer``) and the state it passes to checkpointing and
finishing; the reference's target (``reference``); CFT's loss (``cft``); the do-no-harm gate
(``gate``, ``alpha_gate``); what follows training (``finish``); checkpoints (``checkpoint``,
``checkpoint_check``); option probabilities under many LoRA and α settings (``option_eval``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below load, for readers, type checkers and the structure tests
    from calm_training.methods.calm.config import AS_SPECIFIED, CalmConfig
    from calm_training.methods.calm.data import (
        TRAIN_PART,
        TRAIN_SPLIT_FRACTION,
        TRAIN_SPLIT_SEED,
        UNLABELED_PART,
        load_records,
        resolve_records,
    )
    from calm_training.methods.calm.finish import fit_base_temperature, part_lines
    from calm_training.methods.calm.model import CalmModel
    from calm_training.methods.calm.option_eval import OptionEvaluator
    from calm_training.methods.calm.trainer import latest_checkpoint, train_calm

#: the public names and the module of this folder each lives in
_PUBLIC = {
    "AS_SPECIFIED": "config",
    "CalmConfig": "config",
    "train_calm": "trainer",
    "latest_checkpoint": "trainer",
    "part_lines": "finish",
    "fit_base_temperature": "finish",
    "CalmModel": "model",
    "OptionEvaluator": "option_eval",
    "load_records": "data",
    "resolve_records": "data",
    "TRAIN_PART": "data",
    "UNLABELED_PART": "data",
    "TRAIN_SPLIT_FRACTION": "data",
    "TRAIN_SPLIT_SEED": "data",
}

__all__ = ["AS_SPECIFIED", "CalmConfig", "CalmModel", "OptionEvaluator", "TRAIN_PART",
           "TRAIN_SPLIT_FRACTION", "TRAIN_SPLIT_SEED", "UNLABELED_PART", "fit_base_temperature",
           "latest_checkpoint", "load_records", "part_lines", "resolve_records", "train_calm"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_PUBLIC[name]}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
