"""A training method of ``calm train`` (docs/methods.md §4) and an upper objective ``f``
(``--set upper``): what each learns, which outer step it takes and its objectives. torch-free
(the steps themselves are :mod:`calm_training.calm.bilevel`'s, taken by its ``outer_step``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TrainMethod", "UpperObjective"]


@dataclass(frozen=True)
class TrainMethod:
    """One training method of ``calm train`` (docs/methods.md §4)."""

    name: str
    #: the adapter kind it writes (``lora`` whatever the method with ``--set freeze_alpha=true``)
    kind: str
    #: α's variables: ``("log_tau", "shift")`` over the vocabulary, ``("log_temperature",)``
    #: one learned temperature, or none (θ alone: plain fine-tuning on its own loss)
    alpha: tuple[str, ...] = ("log_tau", "shift")
    #: the outer step of calm_training.calm.bilevel: ``bome`` (the bilevel method),
    #: ``regularization`` (min g + β f), ``iterate`` (alternate a θ step on g and a step
    #: on f) or ``descent`` (plain gradient steps on g)
    solver: str = "bome"
    #: ``iterate``: the f step moves θ and α (else α only)
    theta_path: bool = False
    #: the lower objective g (a loss of CalmModel.objective): ``ce`` on the answer, or
    #: ``cft``, which reads every option and the starting model's bin accuracies
    lower_loss: str = "ce"

    @property
    def theta_only(self) -> bool:
        """No α and no warm start: plain fine-tuning of θ."""
        return not self.alpha

    @property
    def learns_alpha(self) -> bool:
        return bool(self.alpha)

    @property
    def bilevel(self) -> bool:
        return self.solver == "bome"

    @property
    def warm_start(self) -> bool:
        """Whether its first steps are plain LoRA steps (CalmConfig.warm_steps)."""
        return not self.theta_only

    @property
    def default_optimizer(self) -> str:
        """Adam for plain fine-tuning (the usual recipe), SGD for the CALM methods."""
        return "adam" if self.theta_only else "sgd"

    @property
    def reads_all_options(self) -> bool:
        """Its lower objective reads every option of a training question (and needs the
        starting model's confidence-bin accuracies, CFT's E-step), not the answer only."""
        return self.lower_loss == "cft"


@dataclass(frozen=True)
class UpperObjective:
    """One upper objective ``f`` of ``calm train`` (``--set upper``)."""

    name: str
    #: fitted to a pre-trained reference model's option probabilities (``--reference``)
    needs_reference: bool = False
    #: reads the K-option distribution, so only ``--set entropy=options``
    options_only: bool = False

    def loss(self, entropy: str) -> str:
        """Its loss of CalmModel.objective on the calibration batches (``entropy``: the
        entropy kind, calm_data.ENTROPY_KINDS)."""
        if self.needs_reference:
            return "daca_kl"
        return "neg_option_entropy" if entropy == "options" else "neg_entropy"
