"""The state of a ``calm train`` run at a step (:class:`TrainingState`): what the run advances,
what a checkpoint saves and ``--resume`` restores (:mod:`.checkpoint`), typed, so that
neither reaches into the run itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from calm_training.methods.calm.config import CalmConfig
    from calm_training.methods.calm.model import CalmModel, Ranks

__all__ = ["TrainingState"]


@dataclass
class TrainingState:
    """A run's settings, model and optimizers, and how far it is."""

    config: CalmConfig
    #: LoRA θ and α (the tensors the optimizers own)
    model: CalmModel
    #: this process's rank among the data-parallel ones
    dist: Ranks
    #: the method's optimizer (θ and α)
    outer_optimizer: Any
    #: the warm start's (θ alone; None without a warm start)
    warm_optimizer: Any | None
    #: where checkpoints go (None: nowhere)
    checkpoint_dir: Path | None
    #: steps taken
    step: int = 0
    #: one row per step taken (the training curve)
    history: list[dict] = field(default_factory=list)
    #: the training time of the steps taken, across resumed runs (saved in checkpoints)
    seconds: float = 0.0
    #: the last step's checkpoint this run wrote before measuring (:mod:`.checkpoint`)
    made_final_checkpoint: Path | None = None

    @property
    def warming(self) -> bool:
        """Whether the next step is a warm-start (plain LoRA) step."""
        return self.warm_optimizer is not None and self.step < self.config.warm_steps

    @property
    def optimizer(self):
        """The optimizer of the next step (the warm start's, then the method's)."""
        return self.warm_optimizer if self.warming else self.outer_optimizer
