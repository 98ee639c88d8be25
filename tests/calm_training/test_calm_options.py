"""CALM's solver options on a tiny random Llama: the options entropy (value and gradient),
warm start, init_lora, option-token α with its penalty, the option evaluator, the CLI."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import tiny_lora_dir  # noqa: E402

from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.errors import ConfigError, DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm import data as calm_data  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")


def _config(model, data, **kw):
    base = {"model": str(model), "train": (f"{data}:train",),
            "calibration": (f"{data}:unlabeled",), "batch_size": 2, "inner_steps": 2,
            "lora_rank": 4, "max_length": 64, "steps": 2,
            # the BOME paper's inner solver, α written as trained (the gate: test_alpha_gate)
            "inner_optimizer": "sgd", "holdout": 0.0}
    return CalmConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def calm_model(tiny_llama_tied, mc_file):
    """A CalmModel with a nonzero LoRA and random α (so every gradient path is live)."""
    from calm_training.methods.calm.model import CalmModel

    torch.manual_seed(5)
    m = CalmModel(_config(tiny_llama_tied, mc_file), torch.device("cpu"))
    with torch.no_grad():
        for p in m.theta:
            p.normal_(0.0, 0.1)
        m.alpha[0].normal_(0.0, 0.2)
        m.alpha[1].normal_(0.0, 0.5)
    return m


def _option_batch(m, mc_file, variant="mean", mode="cloze", n=3):
    records = calm_data.resolve_records(f"{mc_file}:unlabeled")[:n]
    examples = calm_data.encode_calibration(records, m.tokenizer, mode=mode, chat=False,
                                            max_length=256, entropy="options", variant=variant)
    return records, calm_data.collate(examples, len(examples), pad_id=3)


def _adapter(m):
    tau, shift = m.tau_shift()
    return CalibrationAdapter(base_model=m.identity, tau=tau, shift=shift, centered=m.center)


@pytest.mark.parametrize("variant", ["sum", "mean", "char"])
def test_options_entropy_is_the_entropy_of_the_evaluated_distribution(calm_model, mc_file,
                                                                     variant):
    """f = −H(softmax(s)) with s the cloze scores of the variant, as the project's scorer
    computes them from the calibrated logits of the same model."""
    from calm_training.fit import option_probabilities
    from calm_training.scoring.local import score_multiple_choice

    m = calm_model
    records, batch = _option_batch(m, mc_file, variant)
    value, _, _ = m.objective([batch], "neg_option_entropy")(m.theta, m.alpha, False, False)
    scored = score_multiple_choice(m.lm, m.tokenizer, records, mode="cloze",
                                   calibration=_adapter(m), progress=False)
    p = option_probabilities(scored.scores(variant))
    expected = float(np.mean((p * np.log(p)).sum(axis=1)))
    assert float(value) == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_letter_options_entropy_renormalises_over_the_letters(calm_model, mc_file):
    from calm_training.scoring.local import score_multiple_choice

    m = calm_model
    records, batch = _option_batch(m, mc_file, mode="letter")
    value, _, _ = m.objective([batch], "neg_option_entropy")(m.theta, m.alpha, False, False)
    scored = score_multiple_choice(m.lm, m.tokenizer, records, mode="letter", chat=False,
                                   calibration=_adapter(m), progress=False)
    z = scored.scores()
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert float(value) == pytest.approx(float(np.mean((p * np.log(p)).sum(1))), rel=1e-4)


def test_options_entropy_gradient_matches_finite_differences(calm_model, mc_file):
    m = calm_model
    _, batch = _option_batch(m, mc_file, "mean")
    objective = m.objective([batch], "neg_option_entropy", alpha_l2=0.05)
    theta = [t.detach().double().requires_grad_() for t in m.theta]
    alpha = [a.detach().double().requires_grad_() for a in m.alpha]
    m.peft.double()
    try:
        value, g_theta, g_alpha = objective(theta, alpha, True, True)

        def f_at(th, al):
            return float(objective(th, al, False, False)[0])

        checked = 0
        for group, grads, is_alpha in ((alpha, g_alpha, True), (theta, g_theta, False)):
            for index in range(len(group)):
                flat = grads[index].reshape(-1)
                for coord in torch.topk(flat.abs(), 2).indices.tolist():
                    eps = 1e-4  # float64; the θ path carries ~1e-10 of rounding noise
                    plus = [x.detach().clone() for x in group]
                    minus = [x.detach().clone() for x in group]
                    plus[index].view(-1)[coord] += eps
                    minus[index].view(-1)[coord] -= eps
                    args_p = (theta, plus) if is_alpha else (plus, alpha)
                    args_m = (theta, minus) if is_alpha else (minus, alpha)
                    numeric = (f_at(*args_p) - f_at(*args_m)) / (2 * eps)
                    assert float(flat[coord]) == pytest.approx(numeric, rel=5e-3, abs=1e-7), \
                        (is_alpha, index, coord)
                    checked += 1
                if not is_alpha and index >= 3:
                    break
        assert checked >= 8 and float(g_alpha[1].abs().sum()) > 0
    finally:
        m.peft.float()


def test_options_entropy_needs_options(tiny_llama_tied):
    from transformers import AutoTokenizer

    from calm_runtime.data.sets import OpenQARecord

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_tied))
    with pytest.raises(DataError, match="--set entropy=vocab"):
        calm_data.encode_calibration([OpenQARecord(question="q?", answers=("a",))], tok,
                                     mode="cloze", chat=False, max_length=32, entropy="options")


def test_warm_start_is_plain_lora_then_the_method(tiny_llama_tied, mc_file):
    lora = train_calm(_config(tiny_llama_tied, mc_file, method="lora", steps=2,
                              outer_lr=3e-3), None, progress=False)
    calm = train_calm(_config(tiny_llama_tied, mc_file, steps=3, warm_start_steps=2,
                              warm_start_lr=3e-3, optimizer="sgd", outer_lr=0.05),
                      None, progress=False)
    phases = [row["phase"] for row in calm.history]
    assert phases == ["warm-start", "warm-start", "bilevel"]
    # the same values up to float rounding (CALM's α centres the logits at the identity too)
    assert [r["g"] for r in calm.history[:2]] == pytest.approx([r["g"] for r in lora.history],
                                                               rel=1e-6)
    assert all(r["tau_min"] == r["tau_max"] == 1.0 for r in calm.history[:2])
    assert calm.history[2]["q"] is not None and calm.history[2]["tau_max"] > 1.0
    # the third step started from exactly the θ that plain LoRA reached after two
    assert calm.history[2]["g_identity"] == pytest.approx(
        float(train_calm(_config(tiny_llama_tied, mc_file, method="lora", steps=3,
                                 outer_lr=3e-3), None, progress=False).history[2]["g"]),
        rel=1e-6)
    with pytest.raises(ConfigError, match="warm_start_steps"):
        _config(tiny_llama_tied, mc_file, steps=2, warm_start_steps=2)


def test_init_lora_loads_the_given_weights(tiny_llama_tied, mc_file, tmp_path,
                                           tmp_path_factory):
    source = train_calm(_config(tiny_llama_tied, mc_file, method="lora", steps=2,
                                outer_lr=1e-2), tmp_path / "lora", progress=False)
    from calm_training.methods.calm.model import CalmModel
    from calm_training.methods.calm.trainer import _lora_folder

    for given in (tmp_path / "lora", tmp_path / "lora" / "lora"):  # calm adapter or peft folder
        m = CalmModel(_config(tiny_llama_tied, mc_file), torch.device("cpu"))
        m.load_lora(_lora_folder(str(given)))
        for a, b in zip(m.theta, source.model.theta, strict=True):
            assert torch.equal(a, b)
    started = train_calm(_config(tiny_llama_tied, mc_file, steps=1, init_lora=str(
        tmp_path / "lora")), None, progress=False)
    fresh = train_calm(_config(tiny_llama_tied, mc_file, steps=1), None, progress=False)
    assert started.history[0]["g"] < fresh.history[0]["g"]  # it starts from the trained θ
    other = tiny_lora_dir(tmp_path_factory, tiny_llama_tied)  # r=4 on q, v only
    with pytest.raises(ConfigError, match="lora_targets"):
        train_calm(_config(tiny_llama_tied, mc_file, init_lora=str(other)), None,
                   progress=False)
    with pytest.raises(ConfigError, match="init_lora"):
        train_calm(_config(tiny_llama_tied, mc_file, init_lora=str(tmp_path)), None,
                   progress=False)


def test_option_token_alpha_is_identity_elsewhere(tiny_llama_tied, mc_file, tmp_path):
    result = train_calm(_config(tiny_llama_tied, mc_file, steps=2, alpha_tokens="options",
                                entropy="options", alpha_l2=0.1, upper_params="alpha",
                                outer_lr=1e-2), tmp_path / "tok", progress=False)
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "tok")
    records = calm_data.resolve_records(f"{mc_file}:train") + \
        calm_data.resolve_records(f"{mc_file}:unlabeled")
    allowed = calm_data.answer_token_ids(records, result.model.tokenizer, mode="cloze",
                                         chat=False)
    moved = set(np.flatnonzero((adapter.tau != 1.0) | (adapter.shift != 0.0)).tolist())
    assert moved and moved <= allowed
    assert adapter.method["alpha_token_count"] == len(allowed)
    assert result.model.alpha[0].numel() == len(allowed)


def test_alpha_l2_penalises_alpha_once(calm_model, mc_file):
    m = calm_model
    _, batch = _option_batch(m, mc_file)
    plain, _, _ = m.objective([batch, batch], "neg_option_entropy")(m.theta, m.alpha, False,
                                                                     False)
    penalised, _, g_alpha = m.objective([batch, batch], "neg_option_entropy", alpha_l2=0.3)(
        m.theta, m.alpha, False, True)
    expected = 0.3 * sum(float((a.double() ** 2).sum()) for a in m.alpha)
    assert float(penalised - plain) == pytest.approx(expected, rel=1e-6)
    _, _, g_plain = m.objective([batch, batch], "neg_option_entropy")(m.theta, m.alpha, False,
                                                                      True)
    for a, gp, gq in zip(m.alpha, g_plain, g_alpha, strict=True):
        assert torch.allclose(gq - gp, 0.6 * a.detach(), atol=1e-5)


def test_option_evaluator_equals_the_project_scorer(tiny_llama_tied, mc_file, tmp_path):
    """Shared-context hidden states + any α give the scores of score_multiple_choice on the
    LoRA-merged model with the adapter applied; θ = 0 is the base model."""
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.data.sets import load_dataset
    from calm_training.methods.calm.model import CalmModel
    from calm_training.methods.calm.option_eval import OptionEvaluator
    from calm_training.scoring.local import score_multiple_choice

    trained = train_calm(_config(tiny_llama_tied, mc_file, steps=2, outer_lr=5e-2),
                         tmp_path / "calm", progress=False)
    adapter = CalibrationAdapter.from_pretrained(tmp_path / "calm")
    records = load_dataset(f"{mc_file}:test")[:7]
    m = CalmModel(_config(tiny_llama_tied, mc_file), torch.device("cpu"))
    evaluator = OptionEvaluator(m, variant="mean", batch_size=3)
    m.load_lora(adapter.lora_path)
    # the head temperature (calm train's DACA T) folds into tau and shift:
    # (z/τ + l)/T = z/(τT) + l/T
    t = adapter.temperature
    scores, entropy = evaluator.scores(evaluator.hidden(records), adapter.tau * t,
                                       adapter.shift / t, center=adapter.centered)
    merged, tok, _ = load_model_and_tokenizer(tiny_llama_tied, lora_path=adapter.lora_path)
    expected = score_multiple_choice(merged, tok, records, calibration=adapter,
                                     progress=False).scores("mean")
    np.testing.assert_allclose(scores, expected, atol=2e-5)
    assert np.isfinite(entropy).all() and (entropy > 0).all()
    evaluator.reset_lora()
    base, tok, _ = load_model_and_tokenizer(tiny_llama_tied)
    np.testing.assert_allclose(evaluator.scores(evaluator.hidden(records))[0],
                               score_multiple_choice(base, tok, records, progress=False)
                               .scores("mean"), atol=2e-5)
    assert trained.history[-1]["step"] == 2


def test_train_help_shows_what_a_user_chooses_and_every_setting_is_reachable(capsys):
    """`calm train --help`: at most 27 options (--dtype and --device, as on every command that
    loads a model, are the last two); every other CalmConfig field is a --set NAME
    that --help-settings lists; flags and fields come from one declaration (the field), so
    names, defaults and help lines cannot disagree."""
    import dataclasses

    from calm_training import train_cli
    from calm_training.methods.calm.config import CalmConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    options = [line for line in text.splitlines() if line.startswith("  -")]
    assert len(options) <= 27, options
    assert "iterate-theta" in text and "--set NAME=VALUE" in text
    with pytest.raises(SystemExit):
        main(["train", "--help-settings"])
    listed = capsys.readouterr().out
    fields = {f.name: f for f in dataclasses.fields(CalmConfig)}
    for f in fields.values():
        kind = f.metadata["flag"]
        assert kind in ("option", "set", "command"), f.name
        if kind == "option":
            assert train_cli.flag_of(f) in text and f.metadata["help"][:30] in " ".join(
                text.split()), f.name
        if kind == "set":
            assert f"  {f.name} " in listed and f.metadata["help"] in listed, f.name
    # a --set value is read as the field's type and checked against its choices
    assert train_cli._setting_pair("inner_steps=5") == ("inner_steps", 5)
    assert train_cli._setting_pair("inner_lr=none") == ("inner_lr", None)
    assert train_cli._setting_pair("lora_targets=q_proj,v_proj") == ("lora_targets",
                                                                     ("q_proj", "v_proj"))
    for bad in ("inner_steps=five", "entropy=nats", "no_such=1", "steps"):
        with pytest.raises(argparse.ArgumentTypeError):
            train_cli._setting_pair(bad)


def test_q_growth_warns_once_per_window(caplog):
    from types import SimpleNamespace

    from calm_training.methods.calm.trainer import _Trainer

    fake = SimpleNamespace(config=SimpleNamespace(q_window=3, optimizer="adam"),
                           state=SimpleNamespace(history=[]),
                           q_warnings=0)
    qs = [0.5, 0.4, 0.3, 0.2, 0.2, 0.1, 0.3, 0.4, 0.5]  # falls, then grows
    with caplog.at_level("WARNING", logger="calm_training.methods.calm.trainer"):
        for step, q in enumerate(qs, 1):
            row = {"step": step, "q": q}
            fake.state.history.append(row)
            _Trainer._watch_q(fake, row)
    assert fake.q_warnings == 1  # checked at steps 6 (fell) and 9 (grew)
    assert "q grew from" in caplog.text and "--set optimizer=sgd" in caplog.text


def test_as_specified_is_the_papers_form_and_what_is_given_with_it_wins(monkeypatch, capsys):
    """`calm train --as-specified` applies AS_SPECIFIED (raw logits, vocabulary entropy, ∇f
    on θ and α, no warm start, SGD inner steps, no gate, no T); a --set or --holdout given
    with it wins; its help lists exactly those settings."""
    from calm_runtime.cli.main import main
    from calm_training.methods import calm as calm_method
    from calm_training.methods.calm.config import AS_SPECIFIED

    seen = {}

    def capture(config, out, **_kwargs):
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr(calm_method, "train_calm", capture)
    base = ["train", "--model", "m", "--train", "sciq:train", "--calibration",
            "sciq:unlabeled", "--out", "x", "--as-specified"]
    with pytest.raises(SystemExit):
        main(base)
    config = seen["config"]
    for name, value in AS_SPECIFIED.items():
        assert getattr(config, name) == value, name
    assert config.warm_steps == 0
    with pytest.raises(SystemExit):
        main([*base, "--holdout", "0.5", "--set", "entropy=options"])
    assert seen["config"].holdout == 0.5 and seen["config"].entropy == "options"
    assert seen["config"].alpha_logits == "raw"
    with pytest.raises(SystemExit):
        main(base[:-1])  # the default: not the paper's form
    assert seen["config"].alpha_logits == "centered" and seen["config"].holdout == 400
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, value in AS_SPECIFIED.items():
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"{name}={shown}" in help_text, name
