"""Whether BOME's coupling engages (docs/methods.md §4): λ leaves η when f and q conflict,
and the inner solver must move θ~ away from θ for ∇_α q to be nonzero."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calm_training.methods.calm.bilevel import BomeOptions, bome_step, objective_from_loss  # noqa: E402


def _problem(scale: float = 1.0):
    """lower g = scale·(θ − α)² (θ*(α) = α); upper f = (θ − 2)²: f pulls θ up, the
    constraint θ = α holds it to α. The bilevel solution is θ = α = 2."""
    lower = objective_from_loss(lambda th, al: scale * ((th[0] - al[0]) ** 2).sum())
    upper = objective_from_loss(lambda th, al: ((th[0] - 2.0) ** 2).sum())
    return lower, upper


def test_lambda_leaves_eta_when_f_and_q_conflict_and_reaches_the_known_solution():
    lower, upper = _problem()
    theta = [torch.tensor([0.5], dtype=torch.float64, requires_grad=True)]
    alpha = [torch.tensor([0.0], dtype=torch.float64, requires_grad=True)]
    optimizer = torch.optim.SGD([*theta, *alpha], lr=0.05)
    options = BomeOptions(inner_steps=5, inner_lr=0.1, eta=0.5)
    first = bome_step(theta, alpha, lower, upper, optimizer, options)
    # ⟨∇f, ∇q⟩ < 0 here, so λ = η − ⟨∇f, ∇q⟩/‖∇q‖² > η
    assert first.cos_f_q < 0 and first.lam > options.eta
    assert first.grad_alpha_q_norm > 0.1 and first.inner_move > 0.1
    lams = [first.lam]
    for _ in range(600):
        lams.append(bome_step(theta, alpha, lower, upper, optimizer, options).lam)
    assert sum(lam > options.eta for lam in lams) > len(lams) / 2
    assert float(theta[0]) == pytest.approx(2.0, abs=0.05)
    assert float(alpha[0]) == pytest.approx(2.0, abs=0.1)


def test_sgd_inner_steps_at_lora_scale_leave_the_coupling_at_zero_adam_does_not():
    """With the small gradients of a LoRA (g scaled by 1e-4), two plain inner steps at 0.01
    leave θ~ = θ to 1e-6 and ∇_α q ≈ 0 (α then follows ∇f alone); Adam's steps move θ~ by
    about inner_lr per coordinate whatever the scale, and the coupling is there."""
    stats = {}
    for solver, lr in (("sgd", 0.01), ("adam", 1e-3)):
        lower, _ = _problem(scale=1e-4)
        # f on α only (--upper-params alpha): ⟨∇f, ∇q⟩ = ∇_α f · ∇_α q, zero when ∇_α q is
        upper = objective_from_loss(lambda th, al: ((al[0] - 2.0) ** 2).sum())
        theta = [torch.full((8,), 0.5, dtype=torch.float64, requires_grad=True)]
        alpha = [torch.zeros(8, dtype=torch.float64, requires_grad=True)]
        optimizer = torch.optim.SGD([*theta, *alpha], lr=0.0)  # measure, do not move
        options = BomeOptions(inner_steps=2, inner_lr=lr, inner_optimizer=solver, eta=0.5,
                              upper_theta=False)
        stats[solver] = bome_step(theta, alpha, lower, upper, optimizer, options)
    sgd, adam = stats["sgd"], stats["adam"]
    assert sgd.inner_move < 1e-5 and adam.inner_move > 1e-3
    assert adam.grad_alpha_q_norm > 100 * sgd.grad_alpha_q_norm


def test_inner_optimizer_is_checked():
    from calm_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="inner_optimizer"):
        BomeOptions(inner_optimizer="lbfgs")
