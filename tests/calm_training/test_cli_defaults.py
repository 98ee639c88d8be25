"""Every ``calm fit`` / ``calm eval`` / ``calm train`` option default is its config
dataclass field's default (FitConfig, CalmConfig): one place for both, nothing repeated."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("torch")

from calm_runtime.cli.main import build_parser  # noqa: E402

#: option dest -> config field where the names differ
ALIASES = {"bins": "n_bins"}
#: options whose text the command converts: "" (the CLI) is the empty tuple (the config)
CONVERTED = {"lora_targets": ("", ())}
#: (command, option dest) whose default is the adapter's recorded value: None on the command
#: line, the config field when the adapter records none
RECORDED = {("eval", "variant")}
#: (command, option dest) whose default is None on the command line: "not given", so that
#: the named configuration (``calm train --as-specified``) or else the config field decides
CONFIGURED = {("train", "holdout"), ("train", "daca")}


def _command(name: str) -> argparse.ArgumentParser:
    """The parser of ``calm NAME`` (``fit METHOD``: of one method of ``calm fit``)."""
    parser = build_parser()
    for part in name.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[part]
    return parser


def _checked(command: str, config_class) -> int:
    fields = {f.name: f.default for f in dataclasses.fields(config_class)
              if f.default is not dataclasses.MISSING}
    parser = _command(command)
    applied = {}  # argparse applies the first default of each dest (--chat's, not --no-chat's)
    for action in parser._actions:
        applied.setdefault(action.dest, action.default)
    checked = set()
    for action in parser._actions:
        field = ALIASES.get(action.dest, action.dest)
        if (field not in fields or not action.option_strings or action.required
                or action.help == argparse.SUPPRESS or action.default == argparse.SUPPRESS):
            continue
        default = applied[action.dest]  # what a command line without the option gets
        if (command, action.dest) in RECORDED | CONFIGURED:
            assert default is None, (command, action.option_strings, default)
        elif field in CONVERTED:
            assert (default, fields[field]) == CONVERTED[field]
        else:
            assert default == fields[field], (command, action.option_strings, default,
                                              fields[field])
        checked.add(field)
    return len(checked)


@pytest.mark.parametrize(("command", "least"), [("fit daca", 14), ("fit threshold", 12),
                                               ("eval", 14)])
def test_fit_and_eval_defaults_are_fitconfig_fields(command, least):
    from calm_training.posthoc.fit_config import FitConfig

    assert _checked(command, FitConfig) >= least


def test_train_defaults_are_calmconfig_fields():
    """The options of its own (the rest, --set NAME=VALUE, takes the field's default by
    construction: test_calm_options)."""
    from calm_training.methods.calm.config import CalmConfig

    assert _checked("train", CalmConfig) >= 10
