"""The method registry (calm_training.methods): what each method declares it needs is what
``calm fit`` and ``calm train`` do with it, and an unknown method is one clear error line."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from calm_runtime import modes
from calm_runtime.errors import ConfigError, DataError
from calm_runtime.temperature import TemperatureFit
from calm_training import methods
from calm_training.methods.platt import PlattFit
from calm_training.methods.vector import VectorFit

TRAIN_NAMES = ("bilevel", "regularization", "iterate-theta", "iterate-alpha", "scalar", "lora",
               "cft")


def _option_scores(n=200, k=4, seed=0):
    """Reference and model option logits that mostly agree, and labels (the reference's
    choice 80% of the time)."""
    rng = np.random.default_rng(seed)
    reference = rng.normal(size=(n, k))
    model = 2.5 * reference + 0.5 * rng.normal(size=(n, k))
    labels = np.where(rng.random(n) < 0.8, reference.argmax(1), rng.integers(0, k, n))
    return reference, model, labels


def test_the_lists_are_the_registry_and_keep_their_order():
    from calm_training.methods import LABEL_FREE, METHODS, P_TRUE_METHODS, THETA_ONLY

    assert METHODS == ("vanilla", "naive", "daca", "daca-vector", "ts", "ts-vector")
    assert LABEL_FREE == ("naive", "daca", "daca-vector")
    assert P_TRUE_METHODS == ("vanilla", "naive", "daca", "ts", "platt")
    assert methods.ADAPTER_METHODS == ("naive", "daca", "daca-vector", "ts", "ts-vector",
                                       "threshold")
    assert THETA_ONLY == ("lora", "cft")


def test_the_cli_takes_the_registry_names():
    from calm_runtime.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, names in (("fit", methods.ADAPTER_METHODS), ("train", TRAIN_NAMES)):
        action = next(a for a in sub.choices[command]._actions if a.dest == "method")
        assert tuple(action.choices) == names
    assert {m for m in methods.METHODS if methods.fit_method(m).token_level} == {
        "naive", "daca", "ts"}


@pytest.mark.parametrize("name", methods.METHODS)
def test_an_option_fit_reads_only_what_its_method_declares(name):
    """fit.py passes the reference only to label-free methods and labels only to labeled
    ones: each fits on what it declares, vector methods return a vector fit, and DACA's
    mask is the declared one."""
    method = methods.option_method(name)
    reference, model, labels = _option_scores()
    fit = method.fit_options(model, reference=reference if method.needs_reference else None,
                             labels=labels if method.needs_labels else None)
    assert method.needs_reference != method.needs_labels or method.baseline
    if method.baseline:
        assert fit is None and not method.writes_adapter
        return
    assert isinstance(fit, VectorFit if method.vector else TemperatureFit)
    assert fit.n == len(model)
    if method.needs_reference and not method.vector:
        assert fit.method == ("daca" if method.masked else "naive")
        assert fit.n_used == (int((reference.argmax(1) == model.argmax(1)).sum())
                              if method.masked else len(model))
    assert method.kind == name.replace("-", "_")


def test_a_labeled_method_refuses_records_without_answers():
    from calm_training.posthoc.option_fit import Prepared

    reference, model, labels = _option_scores()
    labels[3] = -1
    for name in methods.METHODS:
        method = methods.option_method(name)
        prep = Prepared(records=[], cal=np.arange(len(model)), test=np.arange(0), k=4,
                        polm=model, plm=reference, labels=labels)
        if method.needs_labels:
            with pytest.raises(DataError, match="have no answer"):
                method.fit_prepared(prep)
        else:
            method.fit_prepared(prep)


@pytest.mark.parametrize("name", methods.P_TRUE_METHODS)
def test_a_p_true_fit_reads_only_what_its_method_declares(name):
    def _p(two_way):  # P(True) of [true, false] logits
        return 1.0 / (1.0 + np.exp(two_way[:, 1] - two_way[:, 0]))

    rng = np.random.default_rng(1)
    reference = rng.normal(size=(200, 2))
    model = 2.0 * reference + 0.3 * rng.normal(size=(200, 2))
    correct = (rng.random(200) < _p(reference)).astype(float)
    method = methods.p_true_method(name)
    fit = method.fit_p_true(model, reference=reference if method.needs_reference else None,
                            correct=correct if method.needs_labels else None)
    if method.baseline:
        assert fit is None
    else:
        assert isinstance(fit, PlattFit if name == "platt" else TemperatureFit)
        assert fit.method.startswith(name)
    assert method.writes_adapter == (name in ("naive", "daca", "ts"))


@pytest.mark.parametrize("name", methods.METHODS)
def test_the_token_level_fit_follows_the_declaration(name):
    """Without models: a method without a token-level counterpart says so, a labeled one
    needs labels, a label-free one a reference with the same tokenizer."""
    from calm_training.posthoc.token_fit import NO_SHARED_TOKENIZER, token_level_fit

    method = methods.fit_method(name)
    fit, record = token_level_fit(method, model=None, tokenizer=None, records=[],
                                  chosen=np.zeros(0), labels=None)
    assert fit is None and not record["fitted"]
    if not method.token_level:
        assert record["reason"] == f"{name} has no token-level counterpart"
    elif method.needs_labels:
        assert record["reason"] == "labels missing on the calibration split"
    else:
        assert record["reason"] == NO_SHARED_TOKENIZER


def test_compare_lists_follow_the_mode_and_the_reference():
    cloze, p_true = modes.mode("cloze"), modes.mode("p_true")
    assert methods.compared_methods(cloze, reference=True) == methods.METHODS
    assert methods.compared_methods(cloze, reference=False) == ("vanilla", "ts", "ts-vector")
    assert methods.compared_methods(p_true, reference=True) == methods.P_TRUE_METHODS
    assert methods.compared_methods(p_true, reference=False) == ("vanilla", "ts", "platt")
    # P(True) keeps the given ones it fits, in their order
    assert methods.compared_methods(p_true, reference=True,
                                    among=("ts", "daca-vector", "naive")) == ("ts", "naive")


def test_an_unknown_fit_method_is_one_error_line(tmp_path):
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.fit_config import FitConfig

    for lookup in (methods.fit_method, methods.option_method, methods.p_true_method):
        with pytest.raises(ConfigError, match=r"^unknown (P\(True\) )?method 'nope'; choose "
                                              r"one of [a-z-]+(, [a-z-]+)+$"):
            lookup("nope")
    # before any model is resolved or scored
    config = FitConfig(model=str(tmp_path / "no-such-model"), data=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        fit_adapter(config, "nope", tmp_path / "out")
    with pytest.raises(ConfigError, match="vanilla is the uncalibrated baseline; choose a "
                                          "method to fit: naive, daca, daca-vector, ts, "
                                          "ts-vector$"):
        fit_adapter(config, "vanilla", tmp_path / "out")


# ---------------------------------------------------------------------------- calm train
def _calm_config(**kw):
    from calm_training.methods.calm.config import CalmConfig

    return CalmConfig(**{"model": "m", "train": ("x:train",), "calibration": ("x:unlabeled",),
                         "steps": 10, **kw})


def test_the_training_lists_are_the_registry():
    from calm_training.methods.calm import config as calm_config
    from calm_training.methods.calm import trainer

    assert calm_config.METHODS == trainer.METHODS == methods.TRAIN_METHOD_NAMES == TRAIN_NAMES
    assert calm_config.UPPER_OBJECTIVES == ("entropy", "daca")
    assert calm_config.KINDS == {"bilevel": "calm", "regularization": "calm_regularization",
                                 "iterate-theta": "calm_iterate_theta",
                                 "iterate-alpha": "calm_iterate_alpha",
                                 "scalar": "calm_scalar", "lora": "lora", "cft": "cft"}


@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_calm_config_follows_the_training_method(name):
    """θ-only methods: Adam by default, no warm start (so warm_start_steps may fill the
    run); the others SGD and half the steps warm."""
    method = methods.train_method(name)
    config = _calm_config(method=name)
    assert config.train_method is method
    assert config.optimizer == method.default_optimizer == ("adam" if method.theta_only
                                                              else "sgd")
    assert config.warm_steps == (0 if method.theta_only else 5)
    assert method.warm_start != method.theta_only
    assert method.learns_alpha != method.theta_only
    assert method.bilevel == (name in ("bilevel", "scalar"))
    assert method.reads_all_options == (name == "cft")
    if method.warm_start:
        with pytest.raises(ConfigError, match="leaves none of the 10 steps"):
            _calm_config(method=name, warm_start_steps=10)
    else:
        assert _calm_config(method=name, warm_start_steps=10).warm_steps == 0


def test_the_upper_objective_declares_its_reference():
    assert methods.upper_objective("entropy").loss("options") == "neg_option_entropy"
    assert methods.upper_objective("entropy").loss("vocab") == "neg_entropy"
    assert methods.upper_objective("daca").loss("options") == "daca_kl"
    with pytest.raises(ConfigError, match="^upper daca needs a reference model; .*upper daca "
                                          "compares option distributions; use --set "
                                          "entropy=options; fix the training settings$"):
        _calm_config(upper="daca", entropy="vocab")
    assert _calm_config(upper="daca", reference="r").upper == "daca"


def test_an_unknown_training_method_is_one_error_line():
    for bad in (lambda: methods.train_method("nope"), lambda: _calm_config(method="nope")):
        with pytest.raises(ConfigError, match=r"^method 'nope' is not one of bilevel, "
                                              r"regularization, iterate-theta, iterate-alpha, "
                                              r"scalar, lora, cft(; fix the training "
                                              r"settings)?$"):
            bad()
    with pytest.raises(ConfigError, match="^upper 'nope' is not one of entropy, daca$"):
        methods.upper_objective("nope")


@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_each_method_takes_its_own_outer_step(name, monkeypatch):
    pytest.importorskip("torch")
    from calm_training.methods.calm import bilevel

    calls = []
    for step in ("bome_step", "regularization_step", "iterate_step", "descent_step"):
        monkeypatch.setattr(bilevel, step, lambda *a, _step=step, **kw: calls.append(
            (_step, a[5:], kw)))
    method = methods.train_method(name)
    method.solver.step("theta", "alpha", "g", "f", "opt", "options", beta=0.7, reduce="mean")
    want = {"bilevel": ("bome_step", ("options",), {}),
            "scalar": ("bome_step", ("options",), {}),
            "regularization": ("regularization_step", (0.7,), {}),
            "iterate-theta": ("iterate_step", (), {"theta_path": True}),
            "iterate-alpha": ("iterate_step", (), {"theta_path": False}),
            "lora": ("descent_step", (), {}), "cft": ("descent_step", (), {})}[name]
    assert calls == [(want[0], want[1], {**want[2], "reduce": "mean"})]


@pytest.mark.usefixtures("private_calm_cache")
@pytest.mark.parametrize(("name", "freeze"), [(n, False) for n in TRAIN_NAMES]
                         + [("bilevel", True)])
def test_the_model_carries_the_alpha_its_method_declares(name, freeze, tiny_llama_tied):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from calm_training.methods.calm.model import CalmModel

    method = methods.train_method(name)
    config = _calm_config(model=str(tiny_llama_tied), method=name, freeze_alpha=freeze,
                          lora_rank=4)
    model = CalmModel(config, torch.device("cpu"))
    expected = () if freeze else method.alpha
    assert tuple(model.alpha_names) == expected
    vocab = model.identity.vocab_size
    assert [a.numel() for a in model.alpha] == [1 if len(expected) == 1 else vocab] * len(
        expected)


def test_freezing_the_scalar_temperature_is_refused():
    """scalar's α is one temperature: --freeze-alpha would have left it training (the
    flag dropped only per-vocabulary α), so the combination is a one-line error."""
    from calm_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="would still train its one temperature"):
        _calm_config(method="scalar", freeze_alpha=True)
    assert _calm_config(method="bilevel", freeze_alpha=True).freeze_alpha
