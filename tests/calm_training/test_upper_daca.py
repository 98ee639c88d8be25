"""CALM's targeted upper objective (calm's extension, docs/methods.md §4): DACA's
agreement-masked KL to a pre-trained reference on the unlabeled calibration set."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.errors import ConfigError  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.model import masked_reference_kl  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def test_masked_kl_by_hand():
    ref = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.5, 0.5, 0.0]], dtype=torch.float64)
    model = torch.tensor([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1], [0.9, 0.1, 0.0]],
                         dtype=torch.float64)
    mask = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])
    logp = torch.log(model).masked_fill(~mask, float("-inf"))
    got = masked_reference_kl(logp, ref, mask)
    first = sum(p * math.log(p / q) for p, q in zip([0.6, 0.3, 0.1], [0.5, 0.25, 0.25],
                                                    strict=True))
    third = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    # question 2 disagrees (reference: option 1, model: option 0): masked out
    assert got.tolist() == pytest.approx([first, 0.0, third])


def test_the_masked_kl_pulls_toward_the_reference_confidence():
    """The optimum of the agreeing term is the reference's distribution, not uniform."""
    ref = torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logits = torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    for _ in range(500):
        opt.zero_grad()
        masked_reference_kl(logits.log_softmax(-1), ref, mask).sum().backward()
        opt.step()
    np.testing.assert_allclose(logits.softmax(-1).detach().numpy(), ref.numpy(), atol=1e-3)


def test_daca_upper_trains_against_a_reference(tiny_llama_tied, mc_file):
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mc_file}:train",),
                        calibration=(f"{mc_file}:unlabeled",), steps=3, warm_start_steps=1,
                        batch_size=2, lora_rank=4, max_length=64, upper="daca",
                        reference=str(tiny_llama_tied), holdout=0.0)
    result = train_calm(config, None, progress=False)
    f = [row["f"] for row in result.history if row["phase"] == "bilevel"]
    assert len(f) == 2 and all(v >= 0 for v in f)  # a (masked) KL, not a negative entropy
    assert result.history[-1]["lam"] is not None


def test_daca_upper_needs_a_reference():
    with pytest.raises(ConfigError, match="--reference"):
        CalmConfig(model="m", train=("a:train",), calibration=("a:unlabeled",), upper="daca")
