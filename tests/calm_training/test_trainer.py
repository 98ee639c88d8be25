"""CALM training on a tiny random Llama: q, tau, the artifact, resume, ablations, composition."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.data.sets import load_dataset, split_indices  # noqa: E402
from calm_runtime.errors import ConfigError, DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _config(model, data, **kw):
    base = {"model": str(model), "train": (f"{data}:train",),
            "calibration": (f"{data}:unlabeled",), "batch_size": 2, "inner_steps": 2,
            "lora_rank": 4, "max_length": 64, "optimizer": "adam", "warm_start_steps": 0,
            # the BOME paper's inner solver, α written as trained (the gate: test_alpha_gate),
            # no temperature after training (test_train_finish)
            "inner_optimizer": "sgd", "holdout": 0.0, "daca": False}
    return CalmConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tiny_llama_tied, mc_file, tmp_path_factory):
    """20 full-batch BOME steps (6 training, 6 calibration questions)."""
    out = tmp_path_factory.mktemp("adapters") / "calm"
    config = _config(tiny_llama_tied, mc_file, batch_size=6, steps=20, outer_lr=1e-2,
                     alpha_lr=1e-2, inner_lr=0.02)
    return train_calm(config, out, progress=False)


def test_bilevel_drives_q_toward_zero_and_keeps_tau_positive(trained):
    q = [row["q"] for row in trained.history]
    # seed 0: q = 0.42 at step 1, 0.063-0.095 over the last five (full batch, T_inner = 2).
    # q < 0 (the inner steps raised g) can happen on a non-convex lower level; it must stay rare
    trajectory = f"q trajectory {np.round(q, 3).tolist()}"
    assert np.mean(np.abs(q[-5:])) < 0.35 * q[0], trajectory
    assert sum(v > 0 for v in q) >= 0.8 * len(q), trajectory
    assert trained.history[-1]["g"] < trained.history[0]["g"]
    tau = trained.adapter.tau
    assert np.isfinite(tau).all() and (tau > 0).all()
    assert tau.min() < 1.0 - 1e-3 or tau.max() > 1.0 + 1e-3  # α moved
    for row in trained.history:
        assert row["lam"] >= 0 and row["grad_q_norm"] > 0 and row["tau_min"] > 0


def test_artifact_round_trips_with_identical_logits(trained, tiny_llama_tied):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from calm_runtime.data.models import load_model_and_tokenizer

    loaded = CalibrationAdapter.from_pretrained(trained.out)
    assert loaded.kind == "calm" and loaded.temperature == 1.0
    assert (loaded.lora_path / "adapter_config.json").is_file()
    m = trained.model
    assert np.array_equal(loaded.tau, torch.exp(m.alpha[0]).detach().numpy())
    assert np.array_equal(loaded.shift, m.alpha[1].detach().numpy())
    assert loaded.provenance["train_data"][0]["n"] == 6
    assert loaded.provenance["seed"] == 0
    assert loaded.method["settings"]["steps"] == 20
    # "variant" is the cloze score variant in every adapter (export and the runtime read it)
    settings = loaded.method["settings"]
    assert loaded.method["solver"] == settings["method"]
    assert loaded.method["variant"] == (settings["cloze_variant"]
                                        if settings["mode"] == "cloze" else None)
    assert loaded.metrics["training"]["last"]["step"] == 20

    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110]])
    with torch.no_grad():
        z = m.lm(input_ids=ids).logits
        expected = m.calibrate(z, m.alpha)
        fresh = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied)).eval()
        reloaded = PeftModel.from_pretrained(fresh, str(loaded.lora_path)).eval()
        actual = loaded.calibrate(reloaded(input_ids=ids).logits)
        merged, _, _ = load_model_and_tokenizer(tiny_llama_tied, lora_path=loaded.lora_path)
        via_merge = loaded.calibrate(merged(input_ids=ids).logits)
    assert torch.equal(actual, expected)
    assert torch.allclose(via_merge, expected, atol=1e-4), float((via_merge - expected).abs().max())


def test_answer_head_matches_the_full_forward(trained, tiny_llama_tied, mc_file):
    """Logits computed only at the answer positions equal the full model's at those positions,
    and the cross-entropy is the mean over each example's answer tokens."""
    from transformers import AutoTokenizer

    m = trained.model
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_tied))
    records = calm_data.resolve_records(f"{mc_file}:train")[:3]
    examples = calm_data.encode_training(records, tok, mode="cloze", chat=False, max_length=64)
    batch = calm_data.collate(examples, len(examples), pad_id=3)
    with torch.no_grad():
        z = m.logits(m.theta, batch)
        full = m.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        gathered = full.reshape(-1, full.shape[-1])[batch.flat_positions]
        value, _, _ = m.objective([batch], "ce")(m.theta, m.alpha, False, False)
    assert torch.allclose(z, gathered, atol=1e-5)
    logp = m.calibrate(gathered, m.alpha).log_softmax(-1)
    nll = -logp[torch.arange(len(batch.targets)), batch.targets]
    by_example, start = [], 0
    for e in examples:
        by_example.append(float(nll[start:start + len(e.positions)].mean()))
        start += len(e.positions)
    assert float(value) == pytest.approx(np.mean(by_example), rel=1e-5)
    flat_ids = batch.input_ids.reshape(-1)
    assert torch.equal(flat_ids[batch.flat_positions + 1], batch.targets)  # next tokens


def test_resume_continues_bit_for_bit(tiny_llama_tied, mc_file, tmp_path):
    config = _config(tiny_llama_tied, mc_file, steps=4, checkpoint_every=2)
    straight = train_calm(config, None, progress=False)
    first = train_calm(_config(tiny_llama_tied, mc_file, steps=2, checkpoint_every=2), None,
                       checkpoint_dir=tmp_path / "ckpt", progress=False)
    assert (tmp_path / "ckpt" / "step-000002" / "tensors.safetensors").is_file()
    assert not list((tmp_path / "ckpt").glob("**/*.pt")) and not list(
        (tmp_path / "ckpt").glob("**/*.bin"))
    resumed = train_calm(config, None, resume=True, checkpoint_dir=tmp_path / "ckpt",
                         progress=False)
    assert first.history == resumed.history[:2]
    assert resumed.history == straight.history
    for a, b in zip(straight.model.theta + straight.model.alpha,
                    resumed.model.theta + resumed.model.alpha, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="inner_lr"):
        train_calm(_config(tiny_llama_tied, mc_file, steps=4, inner_lr=0.1), None, resume=True,
                   checkpoint_dir=tmp_path / "ckpt", progress=False)


@pytest.mark.parametrize("method,mode", [("regularization", "cloze"),
                                         ("iterate-theta", "cloze"), ("iterate-alpha", "cloze"),
                                         ("scalar", "letter")])
def test_ablations_write_their_adapters(method, mode, tiny_llama_tied, mc_file, tmp_path):
    config = _config(tiny_llama_tied, mc_file, method=method, mode=mode, chat=False, steps=2,
                     outer_lr=1e-2)
    result = train_calm(config, tmp_path / method, progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / method)
    assert loaded.kind == f"calm_{method.replace('-', '_')}" and loaded.lora_path is not None
    assert (loaded.tau > 0).all() and np.isfinite(loaded.tau).all()
    if method == "scalar":
        assert np.unique(loaded.tau).size == 1 and loaded.tau[0] != 1.0
        assert (loaded.shift == 0).all()
    else:
        assert result.history[-1]["q"] is None and np.ptp(loaded.shift) > 0


def test_cli_trains_plain_lora(tiny_llama_tied, mc_file, tmp_path, capsys):
    out = tmp_path / "lora"
    rc = main(["-q", "train", "--model", str(tiny_llama_tied), "--train", f"{mc_file}:train",
               "--calibration", f"{mc_file}:unlabeled", "--out", str(out), "--method", "lora",
               "--steps", "2", "--batch-size", "2", "--lora-rank", "2", "--holdout", "0.5",
               "--set", "lora_targets=q_proj,v_proj"])
    assert rc == 0, capsys.readouterr().err
    loaded = CalibrationAdapter.from_pretrained(out)
    # a DACA temperature against the model before the LoRA, when one can be fitted
    kept = loaded.method["daca"]["kept"]
    assert loaded.kind == ("lora+daca" if kept else "lora")
    assert (loaded.tau == 1).all() and (loaded.shift == 0).all()
    assert json.loads((loaded.lora_path / "adapter_config.json").read_text())["r"] == 2
    assert "wrote" in capsys.readouterr().out
    assert main(["train", "--model", str(tiny_llama_tied), "--train", f"{mc_file}:train",
                 "--calibration", f"{mc_file}:unlabeled", "--holdout", "0.5",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "ConfigError" in err and "exists" in err  # exists, no --overwrite


def test_calm_adapter_composes_with_a_post_hoc_fit(trained, tiny_llama_tied, tiny_llama_untied,
                                                  mc_file, tmp_path):
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.fit_config import FitConfig

    config = FitConfig(model=str(tiny_llama_tied), reference=str(tiny_llama_untied),
                       data=str(mc_file), adapter=str(trained.out), bootstrap=0)
    adapter, report = fit_adapter(config, "daca", tmp_path / "calm-daca", progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "calm-daca")
    assert loaded.kind == "calm+daca" and loaded.answer_temperature > 0
    assert np.array_equal(loaded.tau, trained.adapter.tau)
    assert (loaded.lora_path / "adapter_config.json").is_file()


def test_train_unlabeled_and_test_parts_are_disjoint(mc_file):
    everything = load_dataset(str(mc_file))
    train = calm_data.resolve_records(f"{mc_file}:train")
    unlabeled = calm_data.resolve_records(f"{mc_file}:unlabeled")
    _, test = split_indices(len(everything), 0.3, 0)
    test_questions = {everything[i].question for i in test}
    train_q, unlabeled_q = {r.question for r in train}, {r.question for r in unlabeled}
    assert len(train) == 6 and len(unlabeled) == 6
    assert not (train_q & unlabeled_q) and not (train_q & test_questions)
    assert not (unlabeled_q & test_questions)
    assert all(r.answer is not None for r in train) and all(r.answer is None for r in unlabeled)
    with pytest.raises(DataError, match="no answer"):
        calm_data.load_records([f"{mc_file}:unlabeled"], labeled=True)


def test_encoding_positions_and_targets(tiny_llama_tied):
    from transformers import AutoTokenizer

    from calm_runtime.data.sets import MultipleChoiceRecord, OpenQARecord

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_tied))
    mc = MultipleChoiceRecord(question="2 + 2 =", choices=("three", "four"), answer=1)
    cloze = calm_data.encode_training([mc], tok, mode="cloze", chat=False, max_length=64)[0]
    four = tok(" four", add_special_tokens=False)["input_ids"]
    assert cloze.targets == tuple(four) and len(cloze.sequences) == 1
    assert [cloze.sequences[0][p + 1] for _, p in cloze.positions] == four
    unlabeled = calm_data.encode_calibration([mc], tok, mode="cloze", chat=False,
                                             max_length=64)[0]
    assert len(unlabeled.sequences) == 2 and set(unlabeled.targets) == {-1}
    first = calm_data.encode_calibration([mc], tok, mode="cloze", chat=False, max_length=64,
                                         positions="answer")[0]
    assert first.sequences == (unlabeled.sequences[0][:unlabeled.positions[0][1] + 1],)
    assert first.positions == ((0, unlabeled.positions[0][1]),)
    letter = calm_data.encode_training([mc], tok, mode="letter", chat=False, max_length=64)[0]
    assert letter.targets == (tok(" B", add_special_tokens=False)["input_ids"][0],)
    assert letter.positions == ((0, len(letter.sequences[0]) - 1),)
    qa = OpenQARecord(question="Who wrote Hamlet?", answers=("Shakespeare",))
    open_train = calm_data.encode_training([qa], tok, mode="cloze", chat=False, max_length=64)[0]
    assert len(open_train.targets) == len(tok(" Shakespeare", add_special_tokens=False)[
        "input_ids"])
    open_cal = calm_data.encode_calibration([qa], tok, mode="cloze", chat=False, max_length=8)[0]
    assert open_cal.targets == (-1,) and len(open_cal.sequences[0]) == 8  # cut from the left


def test_config_collects_every_problem():
    with pytest.raises(ConfigError) as info:
        CalmConfig(model="m", train=(), calibration=("c",), method="bome", steps=0,
                   inner_lr=-1.0, phi="norm", momentum=1.5)
    message = str(info.value)
    for word in ("method", "phi", "train", "steps", "inner_lr", "momentum"):
        assert word in message


def test_upper_params_all_moves_theta_along_the_finite_difference_gradient_of_f(
        tiny_llama_tied, mc_file):
    """BOME over u = (θ, α) on the real objectives: the θ step of ``upper_params=all`` minus
    that of ``upper_params=alpha`` is ``−lr (∇_θ f + (λ_all − λ_alpha) ∇_θ g)``, and its ∇_θ f
    part matches central finite differences of f (the options entropy on calibration
    questions) along random directions — f's gradient reaches the LoRA."""
    from calm_training.methods.calm.bilevel import BomeOptions, bome_step
    from calm_training.methods.calm.model import Ranks
    from calm_training.methods.calm.trainer import _Trainer

    config = _config(tiny_llama_tied, mc_file, batch_size=6, steps=1, optimizer="sgd",
                     upper_params="all", calibration_positions="options")
    trainer = _Trainer(config, torch.device("cpu"), Ranks("cpu"), None)
    m = trainer.model
    with torch.no_grad():  # a LoRA away from B = 0, so every θ entry has a gradient
        gen = torch.Generator().manual_seed(0)
        for p in m.theta:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        for a in m.alpha:
            a.copy_(0.1 * torch.randn(a.shape, generator=gen))
    lower = m.objective(trainer._batches(trainer.train_examples, 6, 0), "ce")
    upper = m.objective(trainer._batches(trainer.cal_examples, 6, 1), "neg_option_entropy")
    theta0 = [p.detach().clone() for p in m.theta]
    alpha0 = [a.detach().clone() for a in m.alpha]
    lr = 1e-3

    def step(upper_theta):
        theta = [t.clone().requires_grad_() for t in theta0]
        alpha = [a.clone().requires_grad_() for a in alpha0]
        stats = bome_step(theta, alpha, lower, upper, torch.optim.SGD([*theta, *alpha], lr=lr),
                          BomeOptions(inner_steps=2, inner_lr=0.01, eta=0.5,
                                      upper_theta=upper_theta))
        moved = [(t.detach() - t0).reshape(-1) for t, t0 in zip(theta, theta0, strict=True)]
        return torch.cat(moved), stats

    step_all, stats_all = step(True)
    step_alpha, stats_alpha = step(False)
    _, grad_g, _ = lower(theta0, alpha0, True, False)
    grad_g = torch.cat([g.reshape(-1) for g in grad_g])
    # −lr·∇_θ f as the step applied it
    grad_f = -(step_all - step_alpha) / lr - (stats_all.lam - stats_alpha.lam) * grad_g
    assert float(grad_f.norm()) > 1e-3

    def f_at(flat):
        parts, start = [], 0
        for t in theta0:
            parts.append(flat[start:start + t.numel()].view_as(t))
            start += t.numel()
        with torch.no_grad():
            return float(upper(parts, alpha0, False, False)[0])

    flat0 = torch.cat([t.reshape(-1) for t in theta0])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        v = torch.randn(flat0.shape, generator=gen)
        v /= v.norm()
        eps = 1e-2
        fd = (f_at(flat0 + eps * v) - f_at(flat0 - eps * v)) / (2 * eps)
        assert float(grad_f @ v) == pytest.approx(fd, rel=0.05, abs=1e-4)


def test_freeze_alpha_runs_the_schedule_with_theta_alone(tiny_llama_tied, mc_file, tmp_path):
    """The matched control: the method's steps with no α at all; with ``upper_params=alpha``
    f has no gradient left, so λ = η and θ takes λ·∇g steps; the adapter is a plain LoRA."""
    config = _config(tiny_llama_tied, mc_file, steps=3, optimizer="sgd", outer_lr=0.1,
                     upper_params="alpha", freeze_alpha=True, eta=0.5)
    result = train_calm(config, tmp_path / "matched", progress=False)
    loaded = CalibrationAdapter.from_pretrained(tmp_path / "matched")
    assert loaded.kind == "lora" and loaded.lora_path is not None
    assert (loaded.tau == 1).all() and (loaded.shift == 0).all()
    assert result.model.alpha == []
    for row in result.history:
        assert row["lam"] == pytest.approx(0.5, rel=1e-6) and row["cos_f_q"] == 0.0
    assert result.history[-1]["g"] < result.history[0]["g"]


def test_the_q_warning_suggests_only_settings_the_run_can_still_change():
    from types import SimpleNamespace

    from calm_training.methods.calm.trainer import q_grew_fix

    assert q_grew_fix(SimpleNamespace(optimizer="sgd")) == \
        "use a smaller --set outer_lr or a larger --set eta"
    assert q_grew_fix(SimpleNamespace(optimizer="adam")) == \
        "use --set optimizer=sgd, a smaller --set outer_lr or a larger --set eta"
