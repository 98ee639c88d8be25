"""``calm train``: CALM training (docs/methods.md §4), its options and its last lines.

Importing this module is cheap (no torch); the handler imports the trainer.
"""

from __future__ import annotations

import argparse

from calm_runtime.cli.common import show_progress
from calm_runtime.data.models import MODEL_FORMS
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS

__all__ = ["register_train"]

TRAIN_EPILOG = """data parts (disjoint from the test part that `calm eval` scores):
  NAME:train      first half of NAME's 30% calibration part, labeled (cross-entropy)
  NAME:unlabeled  the other half, labels dropped (entropy of the calibrated model)
  NAME may be a named set or a .jsonl file; other specs go to load_dataset unchanged.

examples:
  calm train --model smollm2-135m-instruct --train arc-easy:train \\
      --calibration sciq:unlabeled --out adapters/calm-smollm2
  calm train --model smollm2-135m-instruct --train arc-easy:train \
      --calibration sciq:unlabeled --method lora --out adapters/lora-smollm2  # plain LoRA
  calm train --model smollm2-135m-instruct --train arc-easy:train \
      --calibration sciq:unlabeled --method cft --out adapters/cft-smollm2  # the baseline
  torchrun --nproc_per_node 2 -m calm_runtime.cli.main train --model smollm2-135m-instruct \
      --train arc-easy:train --calibration sciq:unlabeled --out adapters/calm-ddp
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \\
      --adapter adapters/calm-smollm2 --out adapters/calm-daca   # compose with DACA
"""


TRAIN_DESCRIPTION = """\
Fine-tune a LoRA adapter on labeled questions, learn per-token temperatures and shifts
(tau, shift) for the model's output on unlabeled questions, and end with a label-free
temperature, so that the adapter it writes is calibrated (docs/methods.md section 4).

What it writes, in one adapter that calm-export fuses in one step:
  LoRA       the fine-tune (cross-entropy on --train)
  tau/shift  learned on --calibration so that the model's answers are less over-confident
             (by default the entropy of the option distribution with an alpha-only upper
             gradient: an arm of the method; --as-specified gives docs/methods.md's form)
  T          a DACA temperature of the trained model against the model before the LoRA
             (whatever it is: an instruct model stays one) or --reference, fitted on
             --calibration without labels; it keeps every answer (cloze: a temperature on
             the option scores; letter: on the letters' logits); --no-daca skips it

tau/shift and T are each kept only if, on half of the training questions held out of
training (--holdout), they lower the NLL by more than its paired 95% interval and the
interval of their accuracy change stays above -3 points; else dropped, and the adapter and
the last lines say why. The last lines read each part on the other half of the hold-out.
What the defaults do on real data, in and out of domain: docs/results.md.
"""


def register_train(sub) -> None:
    from calm_training.calm.config import (
        ALPHA_LOGITS,
        ALPHA_TOKENS,
        INNER_OPTIMIZERS,
        METHODS,
        OPTIMIZERS,
        UPPER_OBJECTIVES,
        UPPER_PARAMS,
        CalmConfig,
    )

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
    t.add_argument("--method", default=d["method"].default, choices=METHODS,
                   help="bilevel (CALM, the default); ablations: regularization (min g + beta "
                        "f, no constraint), iterate-theta (alternate a LoRA step on g and a "
                        "step of LoRA and tau/shift on f: no coupling, theta path kept), "
                        "iterate-alpha (alternate a LoRA step on g and a tau/shift step on f: "
                        "no coupling, alpha only), scalar (one learned temperature); "
                        "lora = plain LoRA fine-tuning without calibration; cft = calibration-"
                        "aware fine-tuning, the training-time baseline (docs/methods.md)")
    t.add_argument("--mode", default=d["mode"].default, choices=list(CHOICE_MODES),
                   help="multiple choice: CE on the option text (cloze) or its letter")
    chat = t.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="letter mode: apply the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false")
    for flag, kind, text in (
            ("steps", int, "training steps"),
            ("batch-size", int, "training questions per step (over all processes)"),
            ("calibration-batch-size", int, "questions per step from --calibration "
             "(default: --batch-size)"),
            ("grad-accumulation", int, "micro-batches per rank and step"),
            ("inner-steps", int, "gradient steps on a copy of the LoRA per step (how far the "
             "training objective can still fall: what keeps tau/shift from hurting it)"),
            ("inner-lr", float, "step size of those steps (default: 0.001 with adam, 0.01 "
             "with sgd)"),
            ("outer-lr", float, "learning rate of the LoRA (default: 0.1 with sgd, 0.001 "
             "with adam)"),
            ("alpha-lr", float, "learning rate of tau/shift (default: 0.02 with sgd, 0.005 "
             "with adam)"),
            ("momentum", float, "SGD momentum (0 is BOME's step; momentum voids its "
             "guarantee)"),
            ("eta", float, "how strongly each step keeps the LoRA at its best training "
             "loss while tau/shift move (larger: closer)"),
            ("warm-start-steps", int, "the first N of --steps are plain LoRA steps (Adam, "
             "tau/shift fixed at identity) (default: half of --steps)"),
            ("warm-start-lr", float, "Adam learning rate of the warm start"),
            ("alpha-l2", float, "weight of a penalty that keeps tau near 1 and shift near 0"),
            ("q-window", int, "warn when the training loss's distance from its best grew "
             "over the last N steps"),
            ("beta", float, "regularization ablation: weight of the calibration objective"),
            ("cft-weight", float, "cft: w of (1-w)*CE + w*scale*L_cal"),
            ("cft-scale", float, "cft: scale of L_cal"), ("cft-bins", int, "cft: L_cal's bins"),
            ("lora-rank", int, "LoRA rank"), ("lora-alpha", float, "LoRA alpha"),
            ("max-length", int, "longest sequence in tokens"), ("seed", int, "seed"),
            ("limit", int, "use only the first N records of each data spec (default: all)"),
            ("checkpoint-every", int, "checkpoint every N steps (0: never)")):
        name = flag.replace("-", "_")
        shown = "" if "(default" in text else f" (default {d[name].default})"
        t.add_argument(f"--{flag}", type=kind, default=d[name].default, help=text + shown)
    t.add_argument("--holdout", type=_count_or_share, default=d["holdout"].default,
                   metavar="N|SHARE",
                   help="training questions held out of training for the gate of tau/shift "
                        "and T: a count (at most half of the training questions) or a share "
                        "in (0, 1); half decide, half report (0: none, everything written "
                        f"ungated) (default {d['holdout'].default})")
    t.add_argument("--outer-optimizer", "--optimizer", dest="optimizer",
                   default=d["optimizer"].default, choices=OPTIMIZERS,
                   help="outer update: sgd (plain SGD; with --momentum 0, the step whose "
                        "decrease of q BOME guarantees) or adam (rescales the step per "
                        "coordinate; no such guarantee) (default sgd; adam for --method lora)")
    t.add_argument("--inner-optimizer", default=d["inner_optimizer"].default,
                   choices=INNER_OPTIMIZERS,
                   help="inner solver of the LoRA copy: adam (a fresh Adam each outer step; "
                        "moves the copy enough for the coupling to engage) or sgd (the BOME "
                        f"paper's) (default {d['inner_optimizer'].default})")
    t.add_argument("--alpha-logits", default=d["alpha_logits"].default, choices=ALPHA_LOGITS,
                   help="what tau divides: centered (logits minus their vocabulary mean) or "
                        f"raw logits (default {d['alpha_logits'].default})")
    t.add_argument("--upper", default=d["upper"].default, choices=UPPER_OBJECTIVES,
                   help="upper objective: entropy (-H; of the option distribution with "
                        "--entropy options, over the vocabulary with --entropy vocab, the "
                        "paper's) or daca (KL to --reference where the two models agree; "
                        "calm's extension) "
                        f"(default {d['upper'].default})")
    t.add_argument("--reference",
                   help="reference model (the same forms as --model) of --upper daca and "
                        "of the DACA temperature fitted after training (default: the model "
                        "itself before the LoRA, pre-trained or not; a pre-trained model is "
                        "DACA's premise)")
    t.add_argument("--no-daca", dest="daca", action="store_false",
                   help="write the adapter without the DACA temperature that is otherwise "
                        "fitted after training against --reference on the calibration set")
    t.add_argument("--init-lora", metavar="DIR",
                   help="start the LoRA from this peft folder or calm adapter (same rank and "
                        "targets)")
    t.add_argument("--entropy", default=d["entropy"].default, choices=["options", "vocab"],
                   help="the entropy of --upper entropy: of the K-option distribution the "
                        "evaluation reads (options, calm's reading) or of the full next-token "
                        "distribution at the answer positions (vocab, docs/methods.md's -H) "
                        f"(default {d['entropy'].default})")
    t.add_argument("--cloze-variant", default=d["cloze_variant"].default,
                   choices=CLOZE_VARIANTS,
                   help="cloze score variant of the options entropy (default "
                        f"{d['cloze_variant'].default}, as calm fit/eval)")
    t.add_argument("--upper-params", default=d["upper_params"].default, choices=UPPER_PARAMS,
                   help="what f's gradient moves: all (LoRA and tau/shift: BOME as "
                        "docs/methods.md specifies it) or alpha (tau/shift only, an arm: the "
                        "LoRA then moves through lambda*grad q alone) "
                        f"(default {d['upper_params'].default})")
    t.add_argument("--as-specified", action="store_true",
                   help="the bilevel method as docs/methods.md specifies it: --upper-params "
                        "all --entropy vocab (f's gradient on the LoRA too, -H over the "
                        "vocabulary)")
    t.add_argument("--alpha-tokens", default=d["alpha_tokens"].default, choices=ALPHA_TOKENS,
                   help="train tau/shift on the whole vocabulary (all) or only on the tokens "
                        "of the options/answers in the training and calibration data "
                        f"(options; identity elsewhere) (default {d['alpha_tokens'].default})")
    t.add_argument("--freeze-alpha", action="store_true",
                   help="keep tau/shift at the identity and run the method's schedule with "
                        "the LoRA alone: the matched control of a CALM run (adapter kind lora)")
    t.add_argument("--calibration-positions", default=d["calibration_positions"].default,
                   choices=["options", "answer"],
                   help="cloze: entropy at every option-token position (options) or only "
                        "where the answer starts (answer, K times cheaper)")
    t.add_argument("--phi", default=d["phi"].default, choices=["grad", "value"],
                   help="phi = eta*|grad q|^2 (grad) or eta*q (value) (default grad)")
    t.add_argument("--lora-targets", default="",
                   help="comma-separated module names to adapt (default: the model's attention "
                        "projections: q_proj,k_proj,v_proj,o_proj; qkv_proj,o_proj for Phi-3; "
                        "query_key_value,dense for GPT-NeoX)")
    t.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    t.add_argument("--checkpoint-dir", help="default: OUT.checkpoints")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    t.set_defaults(handler=_train)


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


def _train(args) -> int:
    from calm_training.calm.trainer import CalmConfig, train_calm

    names = [f for f in CalmConfig.__dataclass_fields__ if hasattr(args, f)]
    values = {f: getattr(args, f) for f in names}
    values["lora_targets"] = tuple(x.strip() for x in args.lora_targets.split(",") if x.strip())
    values["train"], values["calibration"] = tuple(args.train), tuple(args.calibration)
    if args.as_specified:
        values["upper_params"], values["entropy"] = "all", "vocab"
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
            from calm_training.calm.finish import part_lines

            for line in part_lines(result.daca, result.adapter.metrics.get("holdout_parts")):
                print(line)
    return 0
