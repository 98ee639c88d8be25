"""Calibration-aware fine-tuning (calm_training.methods.calm.cft): the loss against the
published formula, its cross-entropy against CALM's lower level, and a training run on a tiny
random Llama."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.errors import ConfigError, DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.methods.calm.cft import CftBins, cft_loss, estimate_bins, other_targets  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _published(logits, acc_of_bin, count_of_bin, ce, weight, scale):
    """The published trainer's loss for four letters, written out question by question in
    its own terms: ten bins with lower edges 0, 0.1, ..., 0.9 (``bucketize``, right-closed
    lower edge), the top one left out of the loop; log 3 and 3 for K − 1; targets not
    detached. ``logits`` ``[E, 4]`` (a leaf: the gradient is compared too)."""
    edges = torch.linspace(0, 1, 11, dtype=torch.float64)[:10]
    probs = logits.softmax(-1)
    l_cal = torch.zeros((), dtype=torch.float64)
    for p in probs:
        order = p.sort(descending=True).values
        top, others = order[0], order[1:]
        bucket = int(torch.bucketize(top.detach(), edges, right=True)) - 1
        if bucket == 9:  # the published loop stops before the top bin
            continue
        acc, n = acc_of_bin[bucket], count_of_bin[bucket]
        if acc == 1.0:
            targets = torch.zeros(3, dtype=torch.float64)
        else:
            gamma = math.log(3) / others[0] / (1 - acc)
            shaped = torch.tanh(gamma * others)
            a = (1 - acc) / (shaped.sum() + 3)
            targets = a * shaped + a
        l_cal = l_cal + ((top - acc) ** 2 + ((others - targets) ** 2).sum()) / n
    return (1 - weight) * float(np.mean(ce)) + weight * scale * l_cal, l_cal


def _bins():
    return CftBins(accuracy=(0.0, 0.3, 0.45, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 1.0),
                   count=(4, 5, 6, 7, 8, 9, 10, 11, 12, 13))


def _ones(*shape):
    return torch.ones(*shape, dtype=torch.bool)


def _full(n, value):
    return torch.full((n,), value, dtype=torch.float64)


def test_the_loss_and_its_gradient_are_the_published_ones_below_the_top_bin():
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(8, 4)) * 1.5
    raw[0] = [4.0, 0.0, -1.0, -2.0]  # confidence 0.93: the top bin (regularised by calm only)
    raw[1] = [1.0, 1.0, 1.0, 1.0]  # ties
    ce = rng.uniform(0.5, 2.0, size=8)
    bins = _bins()
    mine = torch.as_tensor(raw).requires_grad_(True)
    loss, ce_part, l_cal = cft_loss(mine.log_softmax(-1), torch.as_tensor(ce), _ones(8, 4),
                                    bins, weight=0.3, scale=0.5, weights=_full(8, 1 / 8),
                                    global_batch=8)
    theirs = torch.as_tensor(raw).requires_grad_(True)
    want, want_cal = _published(theirs, bins.accuracy, bins.count, ce, 0.3, 0.5)
    assert float(ce_part.detach()) == pytest.approx(float(np.mean(ce)))
    # calm adds the top-bin question's term, and only it (bin [0.9, 1]: accuracy 1, so the
    # other options' targets are 0; 13 questions)
    order = mine[0].detach().softmax(-1).sort(descending=True).values
    top_term = ((order[0] - 1.0) ** 2 + (order[1:] ** 2).sum()) / 13
    assert float(l_cal.detach()) == pytest.approx(float(want_cal.detach() + top_term),
                                                  rel=1e-10)
    loss.backward()
    want.backward()
    assert torch.allclose(mine.grad[1:], theirs.grad[1:], rtol=1e-9, atol=1e-15)
    assert float(theirs.grad[0].abs().sum()) == 0 < float(mine.grad[0].abs().sum())
    # the other options' targets sum to 1 − acc and keep their order
    others = torch.tensor([[0.3, 0.2, 0.1], [0.5, 0.05, 0.05]], dtype=torch.float64)
    targets = other_targets(others, torch.tensor([0.55, 0.2], dtype=torch.float64),
                            _ones(2, 3))
    assert targets.sum(-1).tolist() == pytest.approx([0.45, 0.8])
    assert (targets[0, :-1] > targets[0, 1:]).all()


def test_an_absent_option_and_data_parallel_shares_change_nothing():
    rng = np.random.default_rng(1)
    bins = _bins()
    three = torch.as_tensor(rng.normal(size=(6, 3))).log_softmax(-1)
    ce = torch.as_tensor(rng.uniform(0.5, 2.0, size=6))

    def loss(option_logp, mask, rows, batch=6):
        n = len(range(6)[rows])
        return float(cft_loss(option_logp[rows], ce[rows], mask[rows], bins, weight=0.5,
                              scale=1.0, weights=_full(n, 1 / n), global_batch=batch)[0])

    everything = slice(None)
    full = loss(three, _ones(6, 3), everything)
    padded = torch.cat([three, torch.full((6, 1), float("-inf"), dtype=torch.float64)], -1)
    mask = torch.cat([_ones(6, 3), torch.zeros(6, 1, dtype=torch.bool)], -1)
    assert loss(padded, mask, everything) == pytest.approx(full, rel=1e-12)
    # two ranks with half the batch each: the mean of their losses is the one-process loss
    halves = [loss(three, _ones(6, 3), rows) for rows in (slice(0, 3), slice(3, 6))]
    assert sum(halves) / 2 == pytest.approx(full, rel=1e-12)


def test_a_bin_empty_before_training_adds_nothing_and_weight_zero_is_the_cross_entropy():
    probs = torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    bins = CftBins(accuracy=(0.0,) * 4 + (0.5,) + (0.0,) * 5, count=(0,) * 4 + (3,) + (0,) * 5)
    weights = torch.full((2,), 0.5, dtype=torch.float64)
    ce = torch.tensor([1.0, 2.0], dtype=torch.float64)
    _, _, l_cal = cft_loss(probs.log(), ce, torch.ones(2, 4, dtype=torch.bool), bins,
                           weight=1.0, scale=1.0, weights=weights, global_batch=2)
    # only the question in the 0.4 bin counts: (0.4 − 0.5)² + its others' terms, over 3
    others = probs[1:, 1:]
    t = other_targets(others, torch.tensor([0.5], dtype=torch.float64),
                      torch.ones(1, 3, dtype=torch.bool))
    assert float(l_cal) == pytest.approx((0.01 + float(((others - t) ** 2).sum())) / 3)
    loss, ce_part, _ = cft_loss(probs.log(), ce, torch.ones(2, 4, dtype=torch.bool), bins,
                                weight=0.0, scale=1.0, weights=weights, global_batch=2)
    assert float(loss) == float(ce_part) == 1.5


def test_bin_estimates():
    probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.95, 0.03, 0.01, 0.01], [0.72, 0.2, 0.05, 0.03],
                      [1.0, 0.0, 0.0, 0.0]])
    bins = estimate_bins(probs, np.array([0, 1, 1, 0]), 10)
    assert bins.count == (0,) * 7 + (2, 0, 2)  # 1.0 falls in the top bin
    assert bins.accuracy[7] == 0.5 and bins.accuracy[9] == 0.5
    with pytest.raises(ConfigError, match="labels"):
        estimate_bins(probs, np.array([0, 1]), 10)


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_the_cross_entropy_part_is_the_lower_level_cross_entropy(mode, tiny_llama_tied,
                                                                  mc_file):
    from calm_training.methods.calm.model import CalmModel, answer_ce
    from calm_training.scoring.local import padding_id

    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mc_file}:train",),
                        calibration=(f"{mc_file}:unlabeled",), method="cft", mode=mode,
                        chat=False, lora_rank=4, max_length=64)
    m = CalmModel(config, torch.device("cpu"))
    with torch.no_grad():  # a LoRA away from zero, so that θ matters
        for t in m.theta:
            t.normal_(0, 0.05)
    records, _ = calm_data.load_records(config.train, labeled=True)
    encode = {"tokenizer": m.tokenizer, "mode": mode, "chat": False, "max_length": 64}
    pad = padding_id(m.tokenizer)
    plain = calm_data.collate(calm_data.encode_training(records, **encode), len(records), pad)
    options = calm_data.collate(calm_data.encode_labeled_options(records, **encode),
                                len(records), pad)
    assert options.labels.tolist() == [r.answer for r in records]
    with torch.no_grad():
        want = float(m.loss(m.theta, [], plain, "ce"))
        logp = m.logits(m.theta, options).log_softmax(-1)
        got = float((answer_ce(logp, options) * options.example_weights).sum())
    assert got == pytest.approx(want, rel=1e-5)


def test_cft_trains_a_lora_toward_the_bin_accuracies(tiny_llama_tied, mc_file, tmp_path):
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mc_file}:train",),
                        calibration=(f"{mc_file}:unlabeled",), method="cft", batch_size=6,
                        steps=8, outer_lr=1e-2, cft_weight=1.0, cft_scale=1.0, lora_rank=4,
                        max_length=64, holdout=0)
    assert config.optimizer == "adam" and config.warm_steps == 0
    result = train_calm(config, tmp_path / "cft", progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "cft")
    kept = loaded.method["daca"]["kept"]  # calm train's temperature, when one fits
    assert loaded.kind == ("cft+daca" if kept else "cft") and loaded.lora_path is not None
    assert (loaded.tau == 1).all() and (loaded.shift == 0).all() and result.model.alpha == []
    assert sum(loaded.method["cft_bins"]["count"]) == 6  # the whole training split
    calibration = [row["cft_l_cal"] for row in result.history]
    # full batch, calibration loss alone: it falls (seed 0: see the assertion message)
    assert calibration[-1] < 0.5 * calibration[0], calibration
    assert all(row["g"] == pytest.approx(row["cft_l_cal"]) for row in result.history)


def test_cft_settings_and_data_are_checked(tiny_llama_tied, tmp_path, capsys):
    import json

    qa_file = tmp_path / "qa.jsonl"
    qa_file.write_text("".join(json.dumps({"question": f"what is item {i}?",
                                           "answers": [f"item {i}"]}) + "\n"
                               for i in range(12)))
    with pytest.raises(ConfigError) as info:
        CalmConfig(model="m", train=("x:train",), calibration=("x:unlabeled",), method="cft",
                   cft_weight=1.5, cft_bins=1, cft_scale=-1.0)
    for word in ("cft_weight", "cft_bins", "cft_scale"):
        assert word in str(info.value)
    with pytest.raises(DataError, match="multiple-choice"):
        calm_data.encode_labeled_options(
            calm_data.load_records([str(qa_file)], labeled=True)[0], None, mode="cloze",
            chat=False, max_length=64)
    rc = main(["train", "--model", str(tiny_llama_tied), "--train", f"{qa_file}:train",
               "--calibration", f"{qa_file}:unlabeled", "--out", str(tmp_path / "x"),
               "--method", "cft", "--steps", "1", "--batch-size", "2", "--set", "entropy=vocab",
               "--holdout", "0"])
    assert rc == 1 and not (tmp_path / "x").exists()
    assert "--method lora" in capsys.readouterr().err
