"""The training methods of ``calm train`` (docs/methods.md §4), their outer steps and the upper
objectives ``f`` (``--set upper``): what each learns, which step it takes and its objectives.
torch-free; a solver's step is :mod:`calm_training.methods.calm.bilevel`'s, imported when a
step is taken.

* CALM: LoRA weights θ and a per-vocabulary α = (τ, shift) trained together, θ on the lower
  objective (the answer's cross-entropy) and α on the upper one, coupled by BOME
  (``bilevel``); its ablations: ``regularization`` (min g + β f), ``iterate-theta`` (alternate
  a θ step on g and a (θ, α) step on f, no coupling), ``iterate-alpha`` (alternate a θ step on
  g and an α step on f, no coupling) and ``scalar`` (BOME with α one learned temperature).
* ``lora``: plain LoRA fine-tuning of θ on the answer's cross-entropy (no α, no warm start):
  what CALM's θ would be without its calibration.
* ``cft``: calibration-aware fine-tuning, the training-time baseline (no α): θ trained on a
  loss that reads every option and the starting model's confidence-bin accuracies
  (:mod:`calm_training.methods.calm.cft`).
* The upper objectives: ``entropy``, the paper's negative entropy of the option
  distribution, and ``daca``, calm's extension: DACA's agreement-masked KL to a pre-trained
  reference.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BILEVEL", "BOME", "CFT", "DACA_UPPER", "DESCENT", "ENTROPY", "ITERATE_ALPHA",
           "ITERATE_THETA", "LORA", "REGULARIZATION", "SCALAR", "Solver", "TrainMethod",
           "UpperObjective"]


# ---------------------------------------------------------------------------- outer steps
class Solver:
    """An outer step: :meth:`step` moves θ and α once (``theta``, ``alpha``: the leaf
    tensors ``optimizer`` owns; ``lower``, ``upper``: the objectives g and f)."""

    #: couples θ and α through the lower problem (the bilevel method)
    bilevel = False

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta, reduce=None):
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class Bome(Solver):
    """BOME's step (``bilevel.bome_step``): f's gradient plus λ times q's, λ from ``options``."""

    bilevel = True

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta, reduce=None):
        from calm_training.methods.calm.bilevel import bome_step

        return bome_step(theta, alpha, lower, upper, optimizer, options, reduce=reduce)


class Regularization(Solver):
    """min g + β f jointly over (θ, α) (``bilevel.regularization_step``)."""

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta, reduce=None):
        from calm_training.methods.calm.bilevel import regularization_step

        return regularization_step(theta, alpha, lower, upper, optimizer, beta, reduce=reduce)


@dataclass(frozen=True, repr=False)
class Iterate(Solver):
    """A θ step on g, then a step on f (``bilevel.iterate_step``): of θ and α when
    ``theta_path``, of α alone otherwise."""

    theta_path: bool = False

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta, reduce=None):
        from calm_training.methods.calm.bilevel import iterate_step

        return iterate_step(theta, alpha, lower, upper, optimizer, theta_path=self.theta_path,
                            reduce=reduce)


class Descent(Solver):
    """Plain gradient steps of θ on g (``bilevel.descent_step``)."""

    def step(self, theta, alpha, lower, upper, optimizer, options, *, beta, reduce=None):
        from calm_training.methods.calm.bilevel import descent_step

        return descent_step(theta, alpha, lower, upper, optimizer, reduce=reduce)


BOME = Bome()
DESCENT = Descent()


# ---------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class TrainMethod:
    """One training method of ``calm train`` (docs/methods.md §4)."""

    name: str
    #: the adapter kind it writes (``lora`` whatever the method with ``--set freeze_alpha=true``)
    kind: str
    #: α's variables: ``("log_tau", "shift")`` over the vocabulary, ``("log_temperature",)``
    #: one learned temperature, or none (θ alone: plain fine-tuning on its own loss)
    alpha: tuple[str, ...] = ("log_tau", "shift")
    #: its outer step
    solver: Solver = BOME
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
        return self.solver.bilevel

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


BILEVEL = TrainMethod("bilevel", kind="calm")
REGULARIZATION = TrainMethod("regularization", kind="calm_regularization",
                             solver=Regularization())
ITERATE_THETA = TrainMethod("iterate-theta", kind="calm_iterate_theta",
                            solver=Iterate(theta_path=True))
ITERATE_ALPHA = TrainMethod("iterate-alpha", kind="calm_iterate_alpha", solver=Iterate())
SCALAR = TrainMethod("scalar", kind="calm_scalar", alpha=("log_temperature",))
LORA = TrainMethod("lora", kind="lora", alpha=(), solver=DESCENT)
CFT = TrainMethod("cft", kind="cft", alpha=(), solver=DESCENT, lower_loss="cft")


# ---------------------------------------------------------------------------- upper objectives
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


ENTROPY = UpperObjective("entropy")
DACA_UPPER = UpperObjective("daca", needs_reference=True, options_only=True)
