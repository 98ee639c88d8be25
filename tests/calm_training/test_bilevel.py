"""The BOME step (docs/methods.md §4) on problems with known answers.

The toy bilevel problem: a strongly convex quadratic lower level
``g(θ, α) = ½ (θ − Bα − b)ᵀ H (θ − Bα − b)`` with ``argmin_θ g = Bα + b``, and a smooth upper
level ``f(θ, α) = ½‖θ − c‖² + ½ μ‖α‖²``, so ``α* = (BᵀB + μI)⁻¹ Bᵀ(c − b)`` and
``θ* = Bα* + b``.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from calm_runtime.errors import ConfigError  # noqa: E402
from calm_training.methods.calm.bilevel import (  # noqa: E402
    BomeOptions,
    bome_step,
    descent_step,
    iterate_step,
    objective_from_loss,
    regularization_step,
)

MU = 0.1


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n, m = 4, 2
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    h = q @ torch.diag(torch.linspace(1.0, 2.0, n, dtype=torch.float64)) @ q.T
    b_mat = torch.randn(n, m, generator=gen, dtype=torch.float64)
    b, c = (torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(2))

    def lower(theta, alpha):
        r = theta[0] - b_mat @ alpha[0] - b
        return 0.5 * r @ h @ r

    def upper(theta, alpha):
        return 0.5 * ((theta[0] - c) ** 2).sum() + 0.5 * MU * (alpha[0] ** 2).sum()

    alpha_star = torch.linalg.solve(b_mat.T @ b_mat + MU * torch.eye(m, dtype=torch.float64),
                                    b_mat.T @ (c - b))
    return lower, upper, alpha_star, b_mat @ alpha_star + b, (h, b_mat, b, c)


def _by_hand_grad_q(h, b_mat, b, theta0, alpha0, inner_steps=3, inner_lr=0.3):
    """``(θ~, ∇_θ g(θ), ∇q)`` of the quadratic written out: ∇_θ g = H r, ∇_α g = −Bᵀ H r."""
    def grads(t, a):
        r = h @ (t - b_mat @ a - b)
        return r, -b_mat.T @ r

    tilde = theta0.clone()
    for _ in range(inner_steps):
        tilde = tilde - inner_lr * grads(tilde, alpha0)[0]
    g_t, g_a = grads(theta0, alpha0)
    return tilde, g_t, torch.cat([g_t, g_a - grads(tilde, alpha0)[1]])


@pytest.mark.parametrize("phi", ["grad", "value"])
def test_toy_bilevel_converges_to_the_closed_form_solution(phi):
    lower, upper, alpha_star, theta_star, _ = _problem()
    theta = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    alpha = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    start = float((alpha.detach() - alpha_star).norm())
    optimizer = torch.optim.Adam([theta, alpha], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 / (1 + k / 25))
    # inner_lr = 1/L for L = max eig(H) = 2: five steps shrink the inner error by 2^5
    options = BomeOptions(inner_steps=5, inner_lr=0.5, eta=1.0, phi=phi)
    for _ in range(600):
        stats = bome_step([theta], [alpha], objective_from_loss(lower),
                          objective_from_loss(upper), optimizer, options)
        schedule.step()
    alpha_err = float((alpha.detach() - alpha_star).norm())
    theta_err = float((theta.detach() - theta_star).norm())
    # measured (seed 0): grad 5.2e-3 / 1.2e-2, value 7.1e-3 / 2.0e-2, from ‖α0 − α*‖ = 1.13
    assert alpha_err < 0.02, f"‖α − α*‖ = {alpha_err:.3g} (start {start:.3g})"
    assert theta_err < 0.04, f"‖θ − θ*‖ = {theta_err:.3g}"
    assert 0 <= stats.q < 1e-3 and stats.lam > 0


def test_one_step_matches_the_update_rule_by_hand():
    """u ← u − d with SGD(lr=1): every quantity of docs/methods.md §4, written out for the
    quadratic."""
    lower, upper, _, _, (h, b_mat, b, c) = _problem(1)
    theta0 = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    alpha0 = torch.tensor([0.4, -0.7], dtype=torch.float64)
    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    options = BomeOptions(inner_steps=3, inner_lr=0.3, eta=0.7)
    stats = bome_step([theta], [alpha], objective_from_loss(lower), objective_from_loss(upper),
                      torch.optim.SGD([theta, alpha], lr=1.0), options)

    tilde, g_t, grad_q = _by_hand_grad_q(h, b_mat, b, theta0, alpha0)
    grad_f = torch.cat([theta0 - c, MU * alpha0])
    q = float(lower([theta0], [alpha0]) - lower([tilde], [alpha0]))
    lam = max((0.7 * float(grad_q @ grad_q) - float(grad_f @ grad_q))
              / (float(grad_q @ grad_q) + options.epsilon), 0.0)
    expected = torch.cat([theta0, alpha0]) - (grad_f + lam * grad_q)
    assert stats.q == pytest.approx(q, rel=1e-12)
    assert stats.lam == pytest.approx(lam, rel=1e-12) and lam > 0
    assert stats.grad_q_norm == pytest.approx(float(grad_q.norm()), rel=1e-12)
    assert torch.allclose(torch.cat([theta.detach(), alpha.detach()]), expected, atol=1e-12)


def test_lambda_is_zero_when_f_already_decreases_q():
    """If ⟨∇f, ∇q⟩ ≥ η‖∇q‖², following ∇f alone decreases q fast enough: λ = 0, d = ∇f."""
    lower, _, _, _, _ = _problem(2)
    theta = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64, requires_grad=True)
    alpha = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    stats = bome_step([theta], [alpha], objective_from_loss(lower), objective_from_loss(lower),
                      torch.optim.SGD([theta, alpha], lr=0.0), BomeOptions(eta=0.5))
    assert stats.lam == 0.0  # f = g: ⟨∇g, ∇q⟩ ≈ ‖∇q‖² > η‖∇q‖²


def test_the_ablation_steps_follow_their_directions():
    lower, upper, _, _, (h, b_mat, b, c) = _problem(3)
    theta0 = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    alpha0 = torch.tensor([0.4, -0.7], dtype=torch.float64)
    r = h @ (theta0 - b_mat @ alpha0 - b)
    lo, up = objective_from_loss(lower), objective_from_loss(upper)

    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    regularization_step([theta], [alpha], lo, up, torch.optim.SGD([theta, alpha], lr=1.0), 0.5)
    assert torch.allclose(theta.detach(), theta0 - (r + 0.5 * (theta0 - c)))
    assert torch.allclose(alpha.detach(), alpha0 - (-b_mat.T @ r + 0.5 * MU * alpha0))

    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    stats = iterate_step([theta], [alpha], lo, up, torch.optim.SGD([theta, alpha], lr=1.0))
    assert torch.allclose(theta.detach(), theta0 - r)
    assert torch.allclose(alpha.detach(), alpha0 - MU * alpha0)  # ∇_α f after the θ step
    assert stats.q is None and stats.lam is None

    # "no coupling, θ path kept": the f step also moves θ, by ∇_θ f at the new θ
    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    iterate_step([theta], [alpha], lo, up, torch.optim.SGD([theta, alpha], lr=1.0),
                 theta_path=True)
    after_g = theta0 - r
    assert torch.allclose(theta.detach(), after_g - (after_g - c))
    assert torch.allclose(alpha.detach(), alpha0 - MU * alpha0)

    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    stats = descent_step([theta], [alpha], lo, up, torch.optim.SGD([theta, alpha], lr=1.0))
    assert torch.allclose(theta.detach(), theta0 - r) and torch.equal(alpha.detach(), alpha0)
    assert stats.f == pytest.approx(float(upper([theta0], [alpha0])))


def test_reduce_sees_every_value_and_gradient():
    """Data parallelism: ``reduce`` gets one flat [value, ∇θ, ∇α] vector per evaluation."""
    lower, upper, _, _, _ = _problem()
    seen = []

    def reduce(vector):
        seen.append(vector.numel())
        return vector

    theta = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    alpha = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    bome_step([theta], [alpha], objective_from_loss(lower), objective_from_loss(upper),
              torch.optim.SGD([theta, alpha], lr=0.1), BomeOptions(inner_steps=2), reduce=reduce)
    # g at θ (value, ∇θ, ∇α); one more inner gradient; g at θ~ (value, ∇α); f (all)
    assert seen == [7, 5, 3, 7]


def test_options_collect_every_problem():
    with pytest.raises(ConfigError) as info:
        BomeOptions(inner_steps=0, inner_lr=-1.0, eta=math.nan, phi="norm")
    message = str(info.value)
    for word in ("inner_steps", "inner_lr", "eta", "phi"):
        assert word in message


def _q_now(lower, theta, alpha, options):
    """``q(u)`` as the step defines it: ``g(θ, α) − g(θ~, α)`` with fresh inner steps."""
    th = [t.detach().clone().requires_grad_() for t in theta]
    tilde = th[0].detach().clone()
    for _ in range(options.inner_steps):
        t = tilde.clone().requires_grad_()
        (grad,) = torch.autograd.grad(lower([t], alpha), [t])
        tilde = tilde - options.inner_lr * grad
    return float((lower(th, alpha) - lower([tilde], alpha)).detach())


@pytest.mark.parametrize("phi", ["grad", "value"])
def test_plain_sgd_step_decreases_q_whenever_lambda_is_positive(phi):
    """BOME's property: with λ > 0, ⟨d, ∇q⟩ ≥ φ > 0, so a small plain-SGD step along −d
    decreases q — and the logged ⟨d, ∇q⟩ says so. (Adam gives no such guarantee.)"""
    positive = 0
    for seed in range(8):
        lower, upper, _, _, _ = _problem(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        theta = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
        alpha = torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_()
        options = BomeOptions(inner_steps=20, inner_lr=0.5, eta=1.0, phi=phi)
        before = _q_now(lower, [theta], [alpha.detach()], options)
        stats = bome_step([theta], [alpha], objective_from_loss(lower),
                          objective_from_loss(upper), torch.optim.SGD([theta, alpha], lr=1e-3),
                          options)
        after = _q_now(lower, [theta], [alpha.detach()], options)
        assert stats.q == pytest.approx(before, rel=1e-9)
        if stats.lam == 0:
            continue
        positive += 1
        phi_value = options.eta * (stats.grad_q_norm ** 2 if phi == "grad" else stats.q)
        assert stats.d_dot_grad_q >= phi_value * (1 - 1e-9) and stats.d_dot_grad_q > 0
        assert after < before, (seed, before, after)
        # the predicted first-order decrease, lr·⟨d, ∇q⟩, is what happened
        assert before - after == pytest.approx(1e-3 * stats.d_dot_grad_q, rel=0.05)
        assert -1.0 <= stats.cos_f_q <= 1.0
    assert positive >= 3, f"only {positive} of 8 starts had λ > 0"


def test_upper_params_alpha_keeps_f_gradient_off_theta():
    """``upper_theta=False``: θ moves by λ∇_θ q only, α by ∇_α f + λ∇_α q."""
    lower, upper, _, _, (h, b_mat, b, c) = _problem(4)
    theta0 = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    alpha0 = torch.tensor([0.4, -0.7], dtype=torch.float64)
    options = BomeOptions(inner_steps=3, inner_lr=0.3, eta=0.7, upper_theta=False)
    theta, alpha = theta0.clone().requires_grad_(), alpha0.clone().requires_grad_()
    stats = bome_step([theta], [alpha], objective_from_loss(lower), objective_from_loss(upper),
                      torch.optim.SGD([theta, alpha], lr=1.0), options)

    _, g_t, grad_q = _by_hand_grad_q(h, b_mat, b, theta0, alpha0)
    grad_f = torch.cat([torch.zeros(4, dtype=torch.float64), MU * alpha0])  # no ∇_θ f
    q_sq = float(grad_q @ grad_q)
    lam = max((0.7 * q_sq - float(grad_f @ grad_q)) / (q_sq + options.epsilon), 0.0)
    assert stats.lam == pytest.approx(lam, rel=1e-12)
    assert torch.allclose(theta.detach(), theta0 - lam * g_t, atol=1e-12)
    assert torch.allclose(alpha.detach(), alpha0 - (MU * alpha0 + lam * grad_q[4:]), atol=1e-12)
    assert stats.grad_f_norm == pytest.approx(float(grad_f.norm()), rel=1e-12)
