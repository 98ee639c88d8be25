"""Calibrating a served model: DACA through `calm serve` against DACA on the local models.

    python benchmarks/served.py                        # ARC-Easy, cloze, full set
    python benchmarks/served.py --limit 100 --mode letter

Exports uncalibrated engines of the model (SmolLM2-135M-Instruct) and the reference
(Gemma-3-270M base), serves them with `calm serve` (the model with `--workers 2`), then runs
`calm eval --compare`'s comparison (vanilla, naive, DACA, TS) twice on the same questions:
with both models loaded locally (transformers) and through the two OpenAI-compatible
endpoints. Reports both tables, the largest differences, the fitted temperatures, and the
wall time of scoring the model through its endpoint at concurrency 1 and 8 (each from an
empty request cache). Writes ``results/served.{json,md}`` naming the command and commit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import command_line, git_commit, model_pair_parser

from calm_runtime.cli.common import install_named
from calm_runtime.data.models import resolve_model
from calm_training.fit import compare_methods
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.fit_report import format_selective_table, format_table
from calm_training.posthoc.plan import FitPlan

HERE = Path(__file__).resolve().parent
METHODS = ("vanilla", "naive", "daca", "ts")
logger = logging.getLogger("served")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export(spec: str, out: Path) -> Path:
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    if not (out / "calm_engine.json").is_file():
        export_engine(spec, out, config=ExportConfig(progress=False))
    return out


def _serve(engine: Path, name: str, workers: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve",
                             str(engine), "--port", str(port), "--model-name", name,
                             "--workers", str(workers), "--max-tokens-limit", "64"],
                            stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return proc, url + "/v1"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"calm serve {engine} did not start") from None
            time.sleep(1)


def markdown(payload: dict) -> str:
    """served.md from served.json."""
    provenance, local, remote = payload["provenance"], payload["local"], payload["remote"]
    cfg = local["config"]
    worst = {k: max((d.get(k, 0.0) for d in payload["differences"].values()), default=0.0)
             for k in ("accuracy", "ece", "nll", "temperature_rel")}
    timings = payload["model_scoring_s_by_concurrency"]
    lines = [f"# Calibrating a served model\n\nProduced by `{provenance['command']}` at commit "
             f"{provenance['commit']} on {provenance['date']}"
             + (f"; rendered by `{provenance['rendered']['command']}` at commit "
                f"{provenance['rendered']['commit']}" if "rendered" in provenance else "")
             + f". The model and the reference as uncalibrated engines behind `calm serve` "
             "(the model with `--workers 2`), against the same models loaded locally; "
             f"{cfg['mode']} mode, no chat template, {local['n_test']} test questions.\n",
             "## Local\n", format_table(local), "",
             "Selective accuracy (local; accuracy of the answers kept at each confidence "
             "threshold, share kept in parentheses):\n", format_selective_table(local), "",
             "## Through the endpoints\n", format_table(remote), "",
             f"Largest local-vs-served difference over the methods: accuracy "
             f"{worst['accuracy']:.2g}, ECE {worst['ece']:.2g}, NLL {worst['nll']:.2g}, "
             f"fitted temperature (relative) {worst['temperature_rel']:.2g}.", "",
             f"Scoring the model's {local['n_records']} questions through its endpoint from an "
             "empty request cache: "
             + ", ".join(f"concurrency {c}: {s} s" for c, s in timings.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = model_pair_parser(__doc__)
    parser.add_argument("--limit", type=int, help="first N questions (default: all)")
    parser.add_argument("--engines", default=str(Path(tempfile.gettempdir()) / "calm-served"),
                        help="where the engines are exported (reused when present)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--render", action="store_true",
                        help="no scoring: rewrite OUT/served.md from OUT/served.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.render:
        path = Path(args.out) / "served.json"
        payload = json.loads(path.read_text())
        payload["provenance"]["rendered"] = {
            "command": "python benchmarks/served.py --render", "commit": git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
        (Path(args.out) / "served.md").write_text(markdown(payload))
        return 0
    install_named([args.model, args.reference], [args.data])  # a command line: it may install
    command = command_line("served.py", argv)
    provenance = {"command": command.strip(), "commit": git_commit(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    engines = Path(args.engines)
    model_engine = _export(args.model, engines / "model")
    reference_engine = _export(args.reference, engines / "reference")
    common = {"data": args.data, "mode": args.mode, "chat": False, "limit": args.limit}
    local = FitConfig(model=str(resolve_model(args.model)),
                      reference=str(resolve_model(args.reference)), **common)
    start = time.perf_counter()
    local_report = compare_methods(local, METHODS)
    local_s = time.perf_counter() - start
    procs = []
    try:
        proc, model_url = _serve(model_engine, "model", workers=2)
        procs.append(proc)
        proc, reference_url = _serve(reference_engine, "reference", workers=1)
        procs.append(proc)
        timings = {}
        from calm_runtime.data.sets import load_dataset
        from calm_runtime.paths import cache_dir
        from calm_training.scoring.served import remote_option_scores

        records = load_dataset(args.data)[: args.limit] if args.limit else load_dataset(
            args.data)
        for concurrency in (1, 8):
            shutil.rmtree(cache_dir("remote"), ignore_errors=True)
            config = FitConfig(model=model_url, reference=reference_url,
                               concurrency=concurrency, **common)
            began = time.perf_counter()
            remote_option_scores(FitPlan.resolve(config).model.endpoint, records,
                                 mode=args.mode)
            timings[concurrency] = round(time.perf_counter() - began, 1)
            logger.info("model through its endpoint at concurrency %d: %.1f s", concurrency,
                        timings[concurrency])
        remote = FitConfig(model=model_url, reference=reference_url, concurrency=8, **common)
        began = time.perf_counter()
        remote_report = compare_methods(remote, METHODS)  # the model's answers are cached
        remote_s = time.perf_counter() - began
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=120)
    for report in (local_report, remote_report):
        report.pop("_panels", None)
    diffs = {}
    for name in METHODS:
        a, b = local_report["methods"][name], remote_report["methods"][name]
        if "error" in a or "error" in b:
            continue
        diffs[name] = {key: abs(a[key] - b[key]) for key in ("accuracy", "ece", "nll")}
        if a.get("fit") and b.get("fit"):
            t_a, t_b = a["fit"]["temperature"], b["fit"]["temperature"]
            diffs[name]["temperature_rel"] = abs(t_a - t_b) / t_a
    payload = {"provenance": provenance, "local": local_report, "remote": remote_report,
               "differences": diffs, "model_scoring_s_by_concurrency": timings,
               "local_compare_s": round(local_s, 1), "remote_compare_s": round(remote_s, 1),
               "served": {"model": "calm serve --workers 2", "reference": "calm serve"}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "served.json").write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")
    text = markdown(payload)
    (out / "served.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
