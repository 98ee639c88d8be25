"""First-order bilevel optimisation (BOME, Liu et al. 2022) on generic parameter lists.

docs/methods.md §4. The lower level ``g(θ, α)`` is minimised over ``θ``; the upper level
``f(θ, α)`` over the joint variable ``u = (θ, α)`` subject to ``θ`` staying a minimiser of
``g``. One outer step (:func:`bome_step`):

1. ``θ~ ← θ``; ``inner_steps`` times ``θ~ ← θ~ − inner_lr · ∇_θ g(θ~, α)`` (α fixed, no graph
   kept through the steps; ``inner_optimizer="adam"`` takes Adam steps instead, with a
   fresh state each outer step). The first inner gradient is taken at ``θ~ = θ``, so that
   evaluation also gives ``g(θ, α)``, ``∇_θ g(θ, α)`` and ``∇_α g(θ, α)``.
2. ``q = g(θ, α) − g(θ~, α)``; ``∇q = [∇_θ g(θ, α) ; ∇_α g(θ, α) − ∇_α g(θ~, α)]``.
3. ``λ = max((φ − ⟨∇f, ∇q⟩) / (‖∇q‖² + ε), 0)`` with ``φ = η‖∇q‖²`` (``phi="grad"``) or
   ``φ = η q`` (``phi="value"``); ``d = ∇f + λ∇q``.
4. ``d`` is written into the parameters' ``.grad`` and the outer optimiser steps.

With ``upper_theta=False`` (``--set upper_params=alpha``) ``∇_θ f`` is left out of ``∇f``: θ then
moves only through ``λ∇_θ q``. Every step reports ``⟨d, ∇q⟩`` and ``cos(∇f, ∇q)``: with
plain SGD the update ``u ← u − lr·d`` decreases ``q`` to first order exactly when
``⟨d, ∇q⟩ > 0``, which ``λ`` guarantees (``⟨d, ∇q⟩ ≥ φ``) whenever ``λ > 0`` — the property
BOME's analysis rests on. Adam rescales ``d`` per coordinate and adds momentum, so it keeps
no such guarantee; the trainer watches ``q`` and warns when it grows.

Whether the coupling engages: ``∇_α q = ∇_α g(θ, α) − ∇_α g(θ~, α)`` vanishes when ``θ~ ≈ θ``
(too few or too small inner steps); then ``λ`` stays at ``η`` and α follows ``∇f`` alone.
Every step therefore also reports ``‖∇_α q‖``, ``‖∇_α f‖`` and how far the inner steps moved
(``‖θ~ − θ‖ / ‖θ‖``). Plain gradient steps on a LoRA move it by ``inner_lr · ‖∇g‖``, tiny
next to its weights; Adam's first steps move every coordinate by about ``inner_lr``
whatever the gradient's scale, which is what makes ``θ~`` differ from ``θ``.

The ablations of the paper use the same machinery: :func:`regularization_step`
(``d = ∇g + β∇f``, no constraint), :func:`iterate_step` (a θ step on ``g``, then a step on
``f`` without the coupling: over α only, or over θ and α with ``theta_path=True``) and
:func:`descent_step` (plain minimisation of one objective, e.g. LoRA fine-tuning without α).
A training method's solver (:mod:`calm_training.methods.calm.method`: ``Bome``,
``Regularization``, ``Iterate``, ``Descent``) takes one of these steps.

Objectives are callables ``objective(theta, alpha, grad_theta, grad_alpha)`` returning
``(value, grads_theta, grads_alpha)``; the step passes leaf tensors whose ``requires_grad``
matches the two flags and the objective returns the gradients asked for (``None`` for the
others). That lets a large model accumulate gradients over micro-batches inside the
objective; :func:`objective_from_loss` wraps a plain scalar loss function. ``reduce`` (a
function of one flat vector) averages every value and gradient over data-parallel ranks
before anything is computed from it, so ``λ`` and ``d`` are global quantities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from calm_runtime.errors import ConfigError

__all__ = [
    "coupling_summary",
    "PHI_MODES",
    "INNER_OPTIMIZERS",
    "Objective",
    "BomeOptions",
    "StepStats",
    "objective_from_loss",
    "bome_step",
    "regularization_step",
    "iterate_step",
    "descent_step",
]

PHI_MODES = ("grad", "value")
INNER_OPTIMIZERS = ("sgd", "adam")
#: Adam's constants for the inner steps (torch.optim.Adam's defaults)
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8

Tensors = Sequence[torch.Tensor]
Grads = list[torch.Tensor] | None
#: ``objective(theta, alpha, grad_theta, grad_alpha) -> (value, grads_theta, grads_alpha)``
Objective = Callable[[Tensors, Tensors, bool, bool], tuple[torch.Tensor, Grads, Grads]]
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class BomeOptions:
    """Settings of one BOME outer step.

    Attributes:
        inner_steps: ``T_inner``, gradient steps on the copy ``θ~`` (>= 1).
        inner_lr: ``η_in``, the step size of those inner steps.
        inner_optimizer: ``"sgd"`` (plain gradient descent, the BOME paper's) or ``"adam"``
            (Adam from a fresh state every outer step: steps of about ``inner_lr`` per
            coordinate whatever the gradient's scale).
        eta: ``η`` in ``φ``; larger values push harder toward the lower-level optimum.
        phi: ``"grad"`` for ``φ = η‖∇q‖²`` (the default of the BOME paper), ``"value"`` for
            ``φ = η q``.
        epsilon: added to ``‖∇q‖²`` in the denominator of ``λ``.
        upper_theta: whether ``f``'s gradient reaches θ (``False``: θ moves only through
            ``λ∇_θ q``; ``f`` then needs no gradient w.r.t. θ, which also saves a backward).
    """

    inner_steps: int = 3
    inner_lr: float = 1e-2
    inner_optimizer: str = "sgd"
    eta: float = 0.5
    phi: str = "grad"
    epsilon: float = 1e-12
    upper_theta: bool = True

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) \
                or self.inner_steps < 1:
            problems.append(f"inner_steps must be an integer >= 1, got {self.inner_steps!r}")
        if not (isinstance(self.inner_lr, (int, float)) and self.inner_lr > 0
                and math.isfinite(self.inner_lr)):
            problems.append(f"inner_lr must be a positive number, got {self.inner_lr!r}")
        if not (isinstance(self.eta, (int, float)) and self.eta >= 0 and math.isfinite(self.eta)):
            problems.append(f"eta must be a finite number >= 0, got {self.eta!r}")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            problems.append(f"inner_optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, "
                            f"got {self.inner_optimizer!r}")
        if self.phi not in PHI_MODES:
            problems.append(f"phi must be one of {', '.join(PHI_MODES)}, got {self.phi!r}")
        if not (isinstance(self.epsilon, (int, float)) and self.epsilon > 0):
            problems.append(f"epsilon must be positive, got {self.epsilon!r}")
        if not isinstance(self.upper_theta, bool):
            problems.append(f"upper_theta must be True or False, got {self.upper_theta!r}")
        if problems:
            raise ConfigError("; ".join(problems) + "; fix the BOME options")


@dataclass(frozen=True)
class StepStats:
    """What one outer step measured (global values under data parallelism).

    ``f`` and ``g`` are taken at the current ``(θ, α)`` before the update; ``g_inner`` is
    ``g(θ~, α)``; ``q``, ``lam``, ``grad_q_norm``, ``d_dot_grad_q`` (``⟨d, ∇q⟩``) and
    ``cos_f_q`` (``cos(∇f, ∇q)``, 0 when either is zero) are ``None`` for steps without the
    bilevel coupling; ``grad_f_norm`` is ``‖∇f‖`` over the variables ``f`` moved.
    ``grad_alpha_q_norm`` (``‖∇_α q‖``), ``grad_alpha_f_norm`` (``‖∇_α f‖``) and
    ``inner_move`` (``‖θ~ − θ‖ / ‖θ‖``) say whether the coupling engages.
    """

    f: float | None
    g: float
    q: float | None = None
    g_inner: float | None = None
    lam: float | None = None
    grad_q_norm: float | None = None
    grad_f_norm: float | None = None
    d_dot_grad_q: float | None = None
    cos_f_q: float | None = None
    grad_alpha_q_norm: float | None = None
    grad_alpha_f_norm: float | None = None
    inner_move: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def objective_from_loss(loss_fn: Callable[[Tensors, Tensors], torch.Tensor]) -> Objective:
    """An :data:`Objective` from ``loss_fn(theta, alpha) -> scalar tensor`` (autograd)."""

    def objective(theta: Tensors, alpha: Tensors, grad_theta: bool, grad_alpha: bool):
        loss = loss_fn(theta, alpha)
        wrt = [*(theta if grad_theta else ()), *(alpha if grad_alpha else ())]
        grads = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if wrt else []
        grads = [torch.zeros_like(w) if gr is None else gr
                 for w, gr in zip(wrt, grads, strict=True)]
        n = len(theta) if grad_theta else 0
        return (loss.detach(), grads[:n] if grad_theta else None,
                grads[n:] if grad_alpha else None)

    return objective


# ---------------------------------------------------------------------------- helpers
def _flat(tensors: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> torch.Tensor:
    if not like:
        return torch.zeros(0)
    return torch.cat([t.reshape(-1).to(like[0].dtype) for t in tensors])


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, start = [], 0
    for t in like:
        out.append(flat[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


def _evaluate(objective: Objective, theta: Tensors, alpha: Tensors, grad_theta: bool,
              grad_alpha: bool, reduce: Reduce | None):
    """``(value, flat ∇_θ or None, flat ∇_α or None)``, averaged over ranks by ``reduce``."""
    th = [t.detach().requires_grad_(grad_theta) for t in theta]
    al = [a.detach().requires_grad_(grad_alpha) for a in alpha]
    value, g_th, g_al = objective(th, al, grad_theta, grad_alpha)
    ref = th[0] if th else al[0]
    parts = [value.detach().reshape(1).to(device=ref.device, dtype=ref.dtype)]
    if grad_theta:
        parts.append(_flat(g_th, th))
    if grad_alpha and al:
        parts.append(_flat(g_al, al))
    packed = torch.cat([p.to(ref.device) for p in parts])
    if reduce is not None:
        packed = reduce(packed)
    n_th = sum(t.numel() for t in th) if grad_theta else 0
    value_out = float(packed[0])
    flat_th = packed[1:1 + n_th] if grad_theta else None
    flat_al = packed[1 + n_th:] if grad_alpha else None
    if flat_al is not None and not al:
        flat_al = packed.new_zeros(0)
    return value_out, flat_th, flat_al


def _apply(params: Sequence[torch.Tensor], direction: torch.Tensor | None,
           optimizer: torch.optim.Optimizer) -> None:
    """Write ``direction`` into ``params``' grads (None: leave them out) and step."""
    if direction is None or not params:
        return
    for p, d in zip(params, _split(direction, params), strict=True):
        p.grad = d.detach().clone().to(p.dtype)
    optimizer.step()
    for p in params:
        p.grad = None


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x.double())) if x.numel() else 0.0


# ---------------------------------------------------------------------------- steps
def bome_step(theta: Sequence[torch.Tensor], alpha: Sequence[torch.Tensor], lower: Objective,
              upper: Objective, optimizer: torch.optim.Optimizer, options: BomeOptions, *,
              reduce: Reduce | None = None) -> StepStats:
    """One BOME outer step over ``u = (θ, α)`` (module docstring); updates both in place.

    ``theta`` and ``alpha`` are the leaf tensors the ``optimizer`` owns; ``θ~`` is a copy of
    ``theta`` only. Cost: ``inner_steps`` gradient evaluations of ``g`` (the first at
    ``θ``), one evaluation of ``g`` at ``θ~`` with gradients for ``α`` only, and one
    gradient evaluation of ``f``.
    """
    theta_now = [t.detach() for t in theta]
    alpha_now = [a.detach() for a in alpha]
    g0, g_theta0, g_alpha0 = _evaluate(lower, theta_now, alpha_now, True, True, reduce)
    tilde = inner_solve(lower, theta_now, alpha_now, g_theta0, options, reduce)
    g_inner, _, g_alpha_inner = _evaluate(lower, tilde, alpha_now, False, True, reduce)
    f, f_theta, f_alpha = _evaluate(upper, theta_now, alpha_now, options.upper_theta, True,
                                    reduce)
    if not options.upper_theta:
        f_theta = torch.zeros_like(g_theta0)
    q = g0 - g_inner
    grad_q = torch.cat([g_theta0, g_alpha0 - g_alpha_inner]).double()
    grad_f = torch.cat([f_theta, f_alpha]).double()
    q_sq = float(grad_q @ grad_q)
    f_dot_q = float(grad_f @ grad_q)
    phi = options.eta * (q_sq if options.phi == "grad" else q)
    lam = max((phi - f_dot_q) / (q_sq + options.epsilon), 0.0)
    direction = grad_f + lam * grad_q
    f_norm = _norm(grad_f)
    cos = f_dot_q / (f_norm * math.sqrt(q_sq)) if f_norm > 0 and q_sq > 0 else 0.0
    d_dot_q = float(direction @ grad_q)
    n_theta = g_theta0.numel()
    move = _norm(_flat(tilde, theta_now) - _flat(theta_now, theta_now))
    size = _norm(_flat(theta_now, theta_now))
    _apply([*theta, *alpha], direction.to(g_theta0.dtype), optimizer)
    return StepStats(f=f, g=g0, q=q, g_inner=g_inner, lam=lam, grad_q_norm=math.sqrt(q_sq),
                     grad_f_norm=f_norm, d_dot_grad_q=d_dot_q, cos_f_q=cos,
                     grad_alpha_q_norm=_norm(grad_q[n_theta:]),
                     grad_alpha_f_norm=_norm(grad_f[n_theta:]),
                     inner_move=move / size if size > 0 else move)


def inner_solve(lower: Objective, theta: Sequence[torch.Tensor], alpha: Sequence[torch.Tensor],
                first_grad: torch.Tensor, options: BomeOptions, reduce: Reduce | None = None
                ) -> list[torch.Tensor]:
    """``θ~`` after ``options.inner_steps`` steps on ``g(·, α)`` from ``θ`` (α fixed);
    ``first_grad`` is the flat ``∇_θ g(θ, α)`` already computed."""
    tilde = [t.clone() for t in theta]
    step = first_grad
    m = v = None
    beta1, beta2 = ADAM_BETAS
    for k in range(options.inner_steps):
        if k:
            _, step, _ = _evaluate(lower, tilde, alpha, True, False, reduce)
        if options.inner_optimizer == "adam":
            m = (1 - beta1) * step if m is None else beta1 * m + (1 - beta1) * step
            v = (1 - beta2) * step * step if v is None else beta2 * v + (1 - beta2) * step * step
            m_hat, v_hat = m / (1 - beta1 ** (k + 1)), v / (1 - beta2 ** (k + 1))
            update = m_hat / (v_hat.sqrt() + ADAM_EPS)
        else:
            update = step
        with torch.no_grad():
            tilde = [t - options.inner_lr * u
                     for t, u in zip(tilde, _split(update, tilde), strict=True)]
    return tilde


def regularization_step(theta: Sequence[torch.Tensor], alpha: Sequence[torch.Tensor],
                        lower: Objective, upper: Objective, optimizer: torch.optim.Optimizer,
                        beta: float, *, reduce: Reduce | None = None) -> StepStats:
    """Minimise ``g + β f`` jointly over ``(θ, α)`` (no bilevel constraint)."""
    theta_now = [t.detach() for t in theta]
    alpha_now = [a.detach() for a in alpha]
    g, g_theta, g_alpha = _evaluate(lower, theta_now, alpha_now, True, True, reduce)
    f, f_theta, f_alpha = _evaluate(upper, theta_now, alpha_now, True, True, reduce)
    grad_f = torch.cat([f_theta, f_alpha])
    direction = torch.cat([g_theta, g_alpha]) + beta * grad_f
    _apply([*theta, *alpha], direction, optimizer)
    return StepStats(f=f, g=g, grad_f_norm=_norm(grad_f))


def iterate_step(theta: Sequence[torch.Tensor], alpha: Sequence[torch.Tensor], lower: Objective,
                 upper: Objective, optimizer: torch.optim.Optimizer, *, theta_path: bool = False,
                 reduce: Reduce | None = None) -> StepStats:
    """Alternate without the coupling ``λ∇q``: a θ step along ``∇_θ g``, then a step on ``f``.

    The ``f`` step moves α only (``theta_path=False``: "no coupling, α only") or θ and α
    together (``theta_path=True``: "no coupling, θ path kept", f's gradient reaches θ as in
    the bilevel step). ``f`` is evaluated after the θ step (at the new θ); the reported ``f``
    and ``g`` are the values each step started from.
    """
    alpha_now = [a.detach() for a in alpha]
    g, g_theta, _ = _evaluate(lower, [t.detach() for t in theta], alpha_now, True, False,
                              reduce)
    _apply(list(theta), g_theta, optimizer)
    f, f_theta, f_alpha = _evaluate(upper, [t.detach() for t in theta], alpha_now, theta_path,
                                    True, reduce)
    if theta_path:
        grad_f = torch.cat([f_theta, f_alpha])
        _apply([*theta, *alpha], grad_f, optimizer)
    else:
        grad_f = f_alpha
        _apply(list(alpha), f_alpha, optimizer)
    return StepStats(f=f, g=g, grad_f_norm=_norm(grad_f))


def descent_step(theta: Sequence[torch.Tensor], alpha: Sequence[torch.Tensor], lower: Objective,
                 upper: Objective | None, optimizer: torch.optim.Optimizer, *,
                 reduce: Reduce | None = None) -> StepStats:
    """Plain minimisation of ``g`` over ``θ`` (α fixed); ``f`` is evaluated for the log only
    when ``upper`` is given (one forward pass, no gradient)."""
    alpha_now = [a.detach() for a in alpha]
    g, g_theta, _ = _evaluate(lower, [t.detach() for t in theta], alpha_now, True, False,
                              reduce)
    f = None
    if upper is not None:
        f, _, _ = _evaluate(upper, [t.detach() for t in theta], alpha_now, False, False, reduce)
    _apply(list(theta), g_theta, optimizer)
    return StepStats(f=f, g=g)


def coupling_summary(history: list[dict], eta: float) -> dict:
    """Whether BOME's coupling engaged over a run's method steps (``history``, the trainer's
    rows): the share of steps with λ > η, the median |λ − η|, the median
    ‖∇_α q‖ / ‖∇_α f‖ and the median inner move ‖θ~ − θ‖ / ‖θ‖ ({} without such steps)."""
    import numpy as np

    rows = [r for r in history if r.get("lam") is not None]
    if not rows:
        return {}
    ratios = [r["grad_alpha_q_norm"] / r["grad_alpha_f_norm"] for r in rows
              if r.get("grad_alpha_f_norm")]
    moves = [r["inner_move"] for r in rows if r.get("inner_move") is not None]
    return {"steps": len(rows),
            "share_lambda_above_eta": sum(r["lam"] > eta for r in rows) / len(rows),
            # λ − η = −⟨∇f, ∇q⟩/‖∇q‖² (clipped at λ = 0): how far the coupling moved λ
            "median_abs_lambda_minus_eta": float(np.median([abs(r["lam"] - eta)
                                                            for r in rows])),
            "median_alpha_q_to_f": float(np.median(ratios)) if ratios else None,
            "median_inner_move": float(np.median(moves)) if moves else None,
            "mean_lambda": float(np.mean([r["lam"] for r in rows])),
            "mean_cos_f_q": float(np.mean([r["cos_f_q"] or 0.0 for r in rows]))}
