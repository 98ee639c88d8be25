"""Do no harm (docs/methods.md §4): α's own effect is measured on held-out training
questions before the adapter is written, with measures that see a reordering, and an α
whose held-out NLL change's interval reaches above the non-inferiority margin (or whose
accuracy interval reaches below -3 points) is not written (the gate's rule itself:
test_gate.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.errors import ConfigError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.methods.calm.alpha_gate import option_share  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.gate import (  # noqa: E402
    ACCURACY_MARGIN,
    NLL_MARGIN,
    decide_part,
)
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _logp(p):
    return np.log(np.asarray(p, dtype=float))


def test_a_reordering_is_seen_though_the_entropy_does_not_move():
    base = _logp([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]])
    swapped = _logp([[0.2, 0.7, 0.1], [0.3, 0.6, 0.1]])  # same entropies, answers swapped
    share = option_share(swapped, base, np.array([0, 0]))
    assert share["entropy_change"] == pytest.approx(0.0, abs=1e-12)
    assert share["flips"] == 2 and share["correctness_flips"] == 2
    assert share["total_variation"] == pytest.approx(0.4)
    assert share["kl_without_to_alpha"] > 0.2 and share["nll_change"] > 0.9  # ln(.7/.2)
    q = share["questions"]
    decision = decide_part("alpha", q["nll_alpha"], q["nll_without"], q["correct_alpha"],
                           q["correct_without"])
    assert not decision["kept"] and "alpha dropped" in decision["reason"]
    assert decision["correctness_changes"] == 2


def test_an_alpha_that_lowers_the_held_out_nll_is_kept():
    base = _logp([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    sharper = _logp([[0.8, 0.2], [0.7, 0.3], [0.75, 0.25]])
    q = option_share(sharper, base, np.array([0, 0, 0]))["questions"]
    decision = decide_part("alpha", q["nll_alpha"], q["nll_without"], q["correct_alpha"],
                           q["correct_without"])
    assert decision["kept"] and "alpha kept" in decision["reason"]


def test_holdout_is_fixed_and_disjoint(mc_file):
    records = calm_data.resolve_records(f"{mc_file}:train")
    held, kept = calm_data.holdout_split(records, 0.25)
    again, _ = calm_data.holdout_split(records, 0.25)
    assert held == again and len(held) == round(0.25 * len(records))
    assert not {r.question for r in held} & {r.question for r in kept}
    # a count is held out whole; training data of fewer than twice as many is refused
    assert len(calm_data.holdout_split(records, 3)[0]) == 3
    n = len(records)
    held, kept = calm_data.holdout_split(records, n // 2)
    assert len(held) == n // 2 and len(held) + len(kept) == n
    with pytest.raises(ConfigError, match=rf"hold-out of 400 questions needs at least 800 "
                                          rf"training questions and the training data has {n}"
                                          r".*--holdout 0\.5.*--holdout 0 "):
        calm_data.holdout_split(records, 400)
    with pytest.raises(ConfigError, match="needs at least"):
        calm_data.holdout_split(records, n // 2 + 1)


def test_the_default_holdout_refuses_training_data_too_small_to_give_it(
        tiny_llama_tied, mc_file, tmp_path):
    """The default hold-out (400: 200 decide) is never cut to what small data can give: the
    run refuses before training and writes nothing; a share asks for less, said weak."""
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mc_file}:train",),
                        calibration=(f"{mc_file}:unlabeled",), steps=1, batch_size=2,
                        calibration_batch_size=2, max_length=64)
    assert config.holdout == 400
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="needs at least 800 training questions"):
        train_calm(config, out, progress=False)
    assert not out.exists()


def test_a_real_train_records_the_share_and_writes_identity_when_it_does_not_help(
        tiny_llama_tied, mc_file, tmp_path):
    """Two real steps with α's learning rate so large that α only does harm: the adapter
    carries the identity, its manifest says why with the numbers, and the share is there."""
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mc_file}:train",),
                        calibration=(f"{mc_file}:unlabeled",), steps=2, warm_start_steps=1,
                        batch_size=2, lora_rank=4, max_length=64, alpha_lr=50.0,
                        alpha_tokens="options", holdout=0.3)
    result = train_calm(config, tmp_path / "a", progress=False)
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "a")
    gate = adapter.method["alpha_gate"]
    share = gate["share"]
    assert gate["holdout"]["deciding"] == share["n"] >= 1
    assert adapter.provenance["train_data"][0]["n"] == gate["holdout"]["n"] + \
        gate["holdout"]["n_train_left"]
    for key in ("nll_alpha", "nll_without", "flips", "total_variation", "kl_without_to_alpha",
                "entropy_change", "accuracy_alpha"):
        assert key in share
    trained_tau, _ = result.trained_alpha
    assert not np.allclose(trained_tau, 1.0)  # α did move in training
    decision = gate["decision"]
    assert decision["n"] == share["n"] == gate["holdout"]["deciding"]
    half = decision["nll_change_half_width"]
    # non-inferiority: kept unless the NLL change's interval reaches above the margin
    assert decision["rule"] == "non-inferiority"
    accuracy_ok = decision["accuracy_change_interval"][0] > -ACCURACY_MARGIN
    if half is None or decision["nll_change"] + half >= NLL_MARGIN or not accuracy_ok:
        assert not gate["kept"] and "alpha dropped" in gate["reason"]
        assert np.all(adapter.tau == 1.0) and np.all(adapter.shift == 0.0)
    else:
        assert gate["kept"] and np.allclose(adapter.tau, trained_tau)
    assert adapter.centered and adapter.metrics["training"]["coupling"]["steps"] == 1


def test_cli_last_line_says_what_the_gate_decided(tiny_llama_tied, mc_file, tmp_path, capsys):
    from calm_runtime.cli.main import main

    code = main(["train", "--model", str(tiny_llama_tied), "--train", f"{mc_file}:train",
                 "--calibration", f"{mc_file}:unlabeled", "--out", str(tmp_path / "b"),
                 "--steps", "2", "--set", "warm_start_steps=1", "--batch-size", "2",
                 "--lora-rank", "4", "--max-length", "64", "--holdout", "0.5", "--quiet"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    gate = next(line for line in lines if "deciding NLL" in line)
    assert "a weak gate" in gate
    assert "alpha kept" in gate or "alpha dropped" in gate
    # then T, and what each part did on the hold-out
    assert any(line.strip().startswith(("DACA against the model before the LoRA",
                                        "no DACA temperature")) for line in lines)
    assert [line.split()[0] for line in lines[-4:]] == ["base", "lora", "lora+alpha",
                                                       "lora+alpha+T"]


def test_open_qa_training_data_is_gated_on_the_answers_token_nll(tiny_llama_tied, tmp_path):
    """No options to compare: the gate reads the held-out answers' token NLL."""
    import json

    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"what is item {i}?",
                                        "answers": [f"item {i}", "thing"]}) + "\n"
                            for i in range(24)))
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{path}:train",),
                        calibration=(f"{path}:unlabeled",), steps=2, warm_start_steps=1,
                        batch_size=2, lora_rank=4, max_length=64, entropy="vocab",
                        holdout=0.5)
    result = train_calm(config, None, progress=False)
    share = result.alpha_gate["share"]
    # 24 records: 12 form :train (the 50% split), half of those are held out
    assert share["measured_on"] == "answer tokens"
    assert share["n"] == result.alpha_gate["holdout"]["deciding"] >= 1
    assert len(share["questions"]["nll_alpha"]) == share["n"]
    decision = result.alpha_gate["decision"]
    assert "accuracy_change" not in decision  # no options: no accuracy to keep
    half = decision["nll_change_half_width"]
    assert result.alpha_gate["kept"] == (half is not None
                                         and decision["nll_change"] + half < NLL_MARGIN)


def test_a_hold_out_with_varying_option_counts_is_measured_and_written(
        tiny_llama_tied, mixed_mc_file, tmp_path):
    """Regression: questions with 2 to 6 options in one hold-out (batches pad to their own
    option count) were stacked as one array and the finished training was lost."""
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mixed_mc_file}:train",),
                        calibration=(f"{mixed_mc_file}:unlabeled",), steps=2,
                        warm_start_steps=1, batch_size=2, lora_rank=4, max_length=64,
                        holdout=0.7)
    train_calm(config, tmp_path / "a", progress=False)
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "a")
    share = adapter.method["alpha_gate"]["share"]
    assert share["n"] >= 5 and np.isfinite(share["nll_alpha"])
    assert len(share["questions"]["nll_alpha"]) == share["n"]
    parts = adapter.metrics["holdout_parts"]
    assert parts["deciding"] == share["n"] and {"base", "lora", "lora+alpha"} <= set(parts["parts"])


def test_cft_reads_every_option_count(tiny_llama_tied, mixed_mc_file, tmp_path):
    config = CalmConfig(model=str(tiny_llama_tied), train=(f"{mixed_mc_file}:train",),
                        calibration=(f"{mixed_mc_file}:unlabeled",), steps=1, method="cft",
                        batch_size=2, lora_rank=4, max_length=64, daca=False)
    train_calm(config, tmp_path / "c", progress=False)
    assert CalibrationAdapter.from_pretrained(tmp_path / "c").method["daca"]["fitted"] is False
