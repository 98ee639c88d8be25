"""``calm train``: CALM training (docs/methods.md §4), its options and its last lines.

Importing this module is cheap (no torch); the handler imports the trainer.
"""

from __future__ import annotations

import argparse

from calm_runtime.cli.common import show_progress
from calm_runtime.data.models import MODEL_FORMS

__all__ = ["register_train"]

TRAIN_EPILOG = """data parts (disjoint from the test part that `calm eval` scores):
  NAME:train      first half of NAME's 30% calibration part, labeled (cross-entropy)
  NAME:unlabeled  the other half, labels dropped (entropy of the calibrated model)
  NAME may be a named set or a .jsonl file; other specs go to load_dataset unchanged.

examples:
  calm train --model smollm2-135m-instruct --train hellaswag:train \\
      --calibration sciq:unlabeled --out adapters/calm-smollm2
  calm train --model smollm2-135m-instruct --train hellaswag:train \\
      --calibration sciq:unlabeled --method lora --out adapters/lora-smollm2  # plain LoRA
  calm train --model smollm2-135m-instruct --train hellaswag:train \\
      --calibration sciq:unlabeled --method cft --out adapters/cft-smollm2  # the baseline
  calm train --model smollm2-135m-instruct --train hellaswag:train \\
      --calibration sciq:unlabeled --set inner_steps=5 --set alpha_tokens=options \\
      --out adapters/calm-tuned   # any other setting (calm train --help-settings)
  calm train --model smollm2-135m-instruct --train arc-easy:train \\
      --calibration arc-easy:unlabeled --holdout 0.5 --out adapters/calm-small  # 86 questions
  torchrun --nproc_per_node 2 -m calm_runtime.cli.main train --model smollm2-135m-instruct \\
      --train hellaswag:train --calibration sciq:unlabeled --out adapters/calm-ddp
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \\
      --adapter adapters/calm-smollm2 --out adapters/calm-daca   # compose with DACA
"""


TRAIN_DESCRIPTION = """\
Fine-tune a LoRA adapter on labeled questions, learn per-token temperatures and shifts
(tau, shift) for the model's output on unlabeled questions, and end with a label-free
temperature; each calibration part is written only where it helps held-out questions
(docs/methods.md section 4).

What it writes, in one adapter that calm-export fuses in one step:
  LoRA       the fine-tune (cross-entropy on --train)
  tau/shift  learned on --calibration to lower the over-confidence of the model's answers
             (by default the entropy of the option distribution with an alpha-only upper
             gradient: an arm of the method; --as-specified gives docs/methods.md's form)
  T          a DACA temperature of the trained model against the model before the LoRA
             (whatever it is: an instruct model stays one) or --reference, fitted on
             --calibration without labels; it keeps every answer (cloze: a temperature on
             the option scores; letter: on the letters' logits); --no-daca skips it

On half of the training questions held out of training (--holdout, 400 by default: 200
decide), tau/shift are kept unless they harm in domain (the paired 95% interval of their NLL
change reaches above +0.02: their claim is out of domain), T only if it lowers the NLL by
more than that interval; each only if the interval of its accuracy change stays above -3
points; else dropped, and the adapter and the last lines say why. The last lines read each
part on the other half of the hold-out. Training data of fewer than 800 questions is refused
with the default hold-out: --holdout 0.5 holds out half instead (a weaker gate, said in the
adapter).
What the defaults do on real data, in and out of domain: docs/results.md.
"""


def register_train(sub) -> None:
    from calm_training.methods.calm import CalmConfig

    d = CalmConfig.__dataclass_fields__
    t = sub.add_parser("train", help="CALM: train LoRA + per-token calibration (bilevel)",
                       description=TRAIN_DESCRIPTION,
                       epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--model", required=True, help=f"the model to fine-tune: {MODEL_FORMS}")
    t.add_argument("--train", action="append", required=True, metavar="SPEC",
                   help="labeled training data (repeatable), e.g. arc-easy:train")
    t.add_argument("--calibration", action="append", required=True, metavar="SPEC",
                   help="unlabeled calibration data (repeatable), e.g. sciq:unlabeled")
    t.add_argument("--out", required=True, help="adapter directory to write")
    for f in settings("option"):  # one option per field, from the field
        shown = "" if "(default" in f.metadata["help"] else f" (default {f.default})"
        t.add_argument(flag_of(f), dest=f.name, type=value_type(f), default=f.default,
                       choices=f.metadata["choices"], help=f.metadata["help"] + shown)
    chat = t.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help=d["chat"].metadata["help"])
    chat.add_argument("--no-chat", dest="chat", action="store_false")
    t.add_argument("--holdout", type=_count_or_share, default=None, metavar="N|SHARE",
                   help=f"{d['holdout'].metadata['help']} (default {d['holdout'].default}; "
                        "0 with --as-specified)")
    t.add_argument("--no-daca", dest="daca", action="store_const", const=False, default=None,
                   help="write the adapter without the DACA temperature that is otherwise "
                        "fitted after training against --reference on the calibration set")
    t.add_argument("--as-specified", action="store_true",
                   help="the method as the paper states it (docs/methods.md section 4, its "
                        "departures table): " + as_specified_text() + "; a --set, --holdout "
                        "or --no-daca given with it wins")
    t.add_argument("--set", dest="settings", action="append", default=[], metavar="NAME=VALUE",
                   type=_setting_pair,
                   help="any other setting, repeatable (tuning and ablations: inner steps, "
                        "learning rates, warm start, the upper objective, alpha's tokens, "
                        "CFT's weights, checkpoints...); --help-settings lists them")
    t.add_argument("--help-settings", action=_ListSettings, nargs=0,
                   help="list every --set NAME with its default and what it does, and exit")
    t.add_argument("--checkpoint-dir", help="where checkpoints go (--set checkpoint_every=N) "
                   "and --resume finds them (default: OUT.checkpoints)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    t.set_defaults(handler=_train)


def settings(flag: str) -> list:
    """The :class:`CalmConfig` fields ``calm train`` offers as ``flag`` (``"option"`` or
    ``"set"``; ``calm_training.methods.calm.config._setting``)."""
    import dataclasses

    from calm_training.methods.calm import CalmConfig

    return [f for f in dataclasses.fields(CalmConfig) if f.metadata.get("flag") == flag]


def flag_of(f) -> str:
    return "--" + f.name.replace("_", "-")


def value_type(f):
    """The Python type a field's text is read as (its annotation without ``None``; the
    dtype in any spelling calm's other commands take)."""
    if f.name == "dtype":
        from calm_runtime.placement import check_dtype

        return check_dtype
    kinds = [k.strip() for k in str(f.type).split("|")]
    for name, kind in (("int", int), ("float", float), ("bool", _boolean)):
        if name in kinds:
            return kind
    return str


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _setting_pair(text: str) -> tuple[str, object]:
    """``--set NAME=VALUE``: the setting and its value read as the field's type (``none`` for
    an optional setting's default; a comma list for lora_targets). Every setting with an
    option of its own is accepted too (``--set steps=3`` as ``--steps 3``)."""
    name, sep, value = text.partition("=")
    fields = {f.name: f for f in (*settings("set"), *settings("option"))}
    if not sep or name.strip() not in fields:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=VALUE with NAME a setting (calm train --help-settings) "
            "or an option's name")
    f = fields[name.strip()]
    value = value.strip()
    if value.lower() == "none" and "None" in str(f.type):
        return f.name, None
    if f.name == "lora_targets":
        return f.name, tuple(x.strip() for x in value.split(",") if x.strip())
    try:
        converted = value_type(f)(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"{f.name}={value!r}: expected {value_type(f).__name__.strip('_')}") from None
    choices = f.metadata["choices"]
    if choices is not None and converted not in choices:
        raise argparse.ArgumentTypeError(f"{f.name}={value!r}: choose from "
                                         f"{', '.join(choices)}")
    return f.name, converted


def settings_text() -> str:
    lines = ["settings (calm train --set NAME=VALUE, repeatable):"]
    for f in settings("set"):
        default = f.default if f.default != () else "(the model's attention projections)"
        choices = f" {{{','.join(f.metadata['choices'])}}}" if f.metadata["choices"] else ""
        lines.append(f"  {f.name}{choices} (default {default})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


class _ListSettings(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        print(settings_text())
        parser.exit()


def _count_or_share(text: str) -> int | float:
    """``--holdout``: an integer count of questions, or a share in [0, 1)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a count of questions nor a share in [0, 1)") from None
    return value


def as_specified_text() -> str:
    """What ``--as-specified`` sets, as ``--set`` would write it (from the one table)."""
    from calm_training.methods.calm import AS_SPECIFIED

    return ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in AS_SPECIFIED.items())


def _train(args) -> int:
    from calm_training.methods.calm import AS_SPECIFIED, CalmConfig, train_calm

    names = [f for f in CalmConfig.__dataclass_fields__ if hasattr(args, f)]
    values = {f: getattr(args, f) for f in names}
    for name in ("holdout", "daca"):  # not given: the configuration's own
        if values.get(name) is None:
            values.pop(name, None)
    if args.as_specified:  # the named configuration, then whatever was given with it
        given = {k: v for k, v in values.items()
                 if k in AS_SPECIFIED and k in ("holdout", "daca")}
        values.update(AS_SPECIFIED)
        values.update(given)
    values["train"], values["calibration"] = tuple(args.train), tuple(args.calibration)
    values.update(dict(args.settings))
    config = CalmConfig(**values)
    result = train_calm(config, args.out, resume=args.resume, overwrite=args.overwrite,
                        checkpoint_dir=args.checkpoint_dir, progress=show_progress(args))
    if result.out is not None and result.history:
        last = result.history[-1]
        print(f"wrote {result.out} (kind {result.adapter.kind}) after {last['step']} steps "
              f"in {result.seconds:.0f} s")
        for key in ("f", "g", "q", "lam"):
            start = next((r[key] for r in result.history if r.get(key) is not None), None)
            if last.get(key) is not None and start is not None:
                print(f"  {key:<4} {start:.4g} -> {last[key]:.4g}")
        summary = result.adapter.summary()
        print(f"  tau [{summary['tau_min']:.4g}, {summary['tau_max']:.4g}]  "
              f"shift [{summary['shift_min']:.4g}, {summary['shift_max']:.4g}]")
        if result.alpha_gate is not None:
            print(f"  {result.alpha_gate['reason']}")
        if result.daca is not None:
            from calm_training.methods.calm import part_lines

            for line in part_lines(result.daca, result.adapter.metrics.get("holdout_parts")):
                print(line)
    return 0
