"""Every arm of the CALM benchmarks pins every training setting: a later change of a
CalmConfig default cannot change what an arm runs (an arm that relied on the default of
``upper_params`` once became another arm when that default changed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from calm_training.methods.calm.config import LEGACY_SETTINGS, CalmConfig

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
#: what a run supplies (model, data, seed and the run's machinery), not an arm's setting
PER_RUN = {"model", "train", "calibration", "seed", "limit", "checkpoint_every", "device", "dtype",
           "init_lora", "chat", "lora_targets", "grad_accumulation"}
SETTINGS = {f.name for f in dataclasses.fields(CalmConfig)} - PER_RUN
#: a setting added after a run was recorded: the run had the behaviour it names there
DEFAULTS = {f.name: LEGACY_SETTINGS.get(f.name, f.default) for f in dataclasses.fields(CalmConfig)}


@pytest.fixture(scope="module")
def scripts(benchmark_scripts):
    with benchmark_scripts("calm_replication", "calm_decisive", "_decisive_design") as modules:
        yield {**modules, "calm_decisive": modules["_decisive_design"]}  # where the arms live


def test_replication_arms_pin_every_setting_at_the_recorded_value(scripts):
    bench = scripts["calm_replication"]
    set_by_the_run = {"steps", "warm_start_steps", "eta"}  # flags of the script, recorded
    recorded = json.loads((BENCHMARKS / "results/calm_replication.json").read_text())
    for arm, own in bench.ARMS.items():
        settings = {**bench.COMMON, **own}
        assert SETTINGS - set_by_the_run <= set(settings), (arm, SETTINGS - set(settings))
        for direction, info in recorded["directions"].items():
            ran = info["runs"][arm]["settings"]
            probed = {"outer_lr", "alpha_lr"} if arm in bench.PROBE_LR else set()
            for key in set(settings) - probed:
                # a setting added after the run: it ran as that setting's default
                value = ran.get(key, DEFAULTS[key])
                assert value == settings[key], (direction, arm, key, value, settings[key])
    # the α-only arm and its predecessor differ only where they say they do
    sgd, alpha = (bench.ARMS[a] for a in ("calm-sgd-options", "calm-sgd-options-alpha"))
    assert (sgd["upper_params"], alpha["upper_params"]) == ("all", "alpha")


def test_decisive_arms_pin_every_setting(scripts):
    bench = scripts["calm_decisive"]
    gate = {"mode": "cloze", "alpha_tokens": "options", "alpha_lr": 0.2}
    for default in bench.CANDIDATES:
        for arm in bench.ARMS:
            settings = bench.arm_settings(arm, gate, default)
            assert SETTINGS <= set(settings), (arm, SETTINGS - set(settings))
            CalmConfig(model="m", train=("x:train",), calibration=("x:unlabeled",),
                       **settings)  # valid as a whole
        matched = bench.arm_settings("lora-matched", gate, default)
        # the matched control is the default arm's schedule with α frozen, nothing else
        assert {k: v for k, v in matched.items() if k != "freeze_alpha"} == \
            {k: v for k, v in bench.arm_settings(default, gate, None).items()
             if k != "freeze_alpha"}
        assert matched["freeze_alpha"] is True
    assert bench.arm_settings("calm-bome-all", gate, None)["upper_params"] == "all"
    assert bench.arm_settings("calm-bome-alpha", gate, None)["upper_params"] == "alpha"
    with pytest.raises(SystemExit, match="chosen after"):
        bench.arm_settings("lora-matched", gate, None)


def test_the_decisive_shipped_arm_is_the_earlier_calm_train(scripts):
    """calm_decisive's third-round arm is `calm train` as it shipped before the gate of T
    (a 20% hold-out): every CalmConfig default but that one, pinned, so that its recorded
    runs stay what they were; benchmarks/calm_train_ood.py reads today's defaults."""
    bench = scripts["calm_decisive"]
    defaults = {f.name: f.default for f in dataclasses.fields(CalmConfig)
                if f.name not in PER_RUN}
    shipped = bench.arm_settings(bench.SHIPPED, {"mode": "letter", "alpha_tokens": "options",
                                                 "alpha_lr": 2.0}, None)
    assert {k: v for k, v in shipped.items() if k != "holdout"} == \
        {k: v for k, v in defaults.items() if k != "holdout"}
    assert shipped["holdout"] == 0.2


def test_calm_train_ood_runs_calm_train_as_users_run_it(benchmark_scripts):
    """Only the model, the data, the seed and the hold-out (half: sciq:train's 150 questions
    cannot give the default 400, which calm train refuses below 800): every other training
    setting is CalmConfig's default (a smoke run alone overrides steps too)."""
    with benchmark_scripts("calm_train_ood") as bench:
        assert bench.parse_args([]).overrides == {}
        config = bench.seed_config(bench.parse_args([]), 1)
        plain = CalmConfig(model="m", train=("x:train",), calibration=("x:unlabeled",))
        changed = {f.name for f in dataclasses.fields(CalmConfig)
                   if getattr(config, f.name) != getattr(plain, f.name)}
        assert changed == {"model", "train", "calibration", "seed", "holdout"}
        assert config.holdout == 0.5
        assert set(bench.parse_args(["--smoke"]).overrides) == {"steps", "warm_start_steps",
                                                                "holdout"}


def test_calm_train_gate_runs_calm_train_with_every_default(benchmark_scripts, tmp_path):
    """calm_train_gate reads the gate as users get it: only the model, the data and the seed
    are its own, so the hold-out is the default 400 (200 deciding), and the data is large
    enough for it; its report says what the manifest decided, part by part."""
    with benchmark_scripts("calm_train_gate") as bench:
        config = bench.config_for(bench.parse_args(["--out", str(tmp_path)]))
        plain = CalmConfig(model="m", train=("x:train",), calibration=("x:unlabeled",))
        changed = {f.name for f in dataclasses.fields(CalmConfig)
                   if getattr(config, f.name) != getattr(plain, f.name)}
        assert changed == {"model", "train", "calibration"} and config.holdout == 400
        gate = {"kept": False, "reason": "T dropped: its NLL gain is within the interval"}
        payload = {
            "command": "c", "commit": "abc", "date": "d", "train_s": 10.0, "kind": "calm",
            "settings": {"steps": 200},
            "holdout": {"n": 400, "deciding": 200, "reporting": 200, "n_train_left": 1107},
            "alpha": {"kept": True, "reason": "alpha kept: it lowers the deciding NLL"},
            "temperature": {"fitted": True, "kept": False, "answer_temperature": 1.5,
                            "token_temperature": 1.2, "gate": gate},
            "parts": {"n": 400, "deciding": 200, "reporting": 200, "read_on": "reporting",
                      "parts": {"lora": {"accuracy": 0.5, "ece": 0.1, "nll": 1.0,
                                         "mean_confidence": 0.6}}}}
        text = bench.render(payload)
        assert bench.config_for(bench.parse_args(["--out", str(tmp_path), "--steps", "50"])
                                ).steps == 50
        fewer = bench.render({**payload, "settings": {"steps": 50}})
    assert "every default on" in text and "every default but 50 steps on" in fewer
    assert "(1507 questions)" in text and "400 held out (200 decide, 200 report)" in text
    assert "| τ/l | yes | alpha kept" in text and "| T | no | T dropped" in text
    assert "| lora | 0.500 | 0.100 | 1.000 | 0.600 |" in text
