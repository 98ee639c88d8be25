"""Abstention on ARC-Easy: the threshold `calm fit threshold` chooses, and what it keeps.

    python benchmarks/threshold.py                       # ARC-Easy, cloze, full set
    python benchmarks/threshold.py --risk 0.1 0.3 0.6 --limit 200

For SmolLM2-135M-Instruct uncalibrated (``vanilla``) and with a label-free DACA temperature
(Gemma-3-270M base as the reference), ``calm fit threshold`` at each target risk ``--risk``
(confidence ``--confidence``): the threshold chosen on the calibration split (30%, seed 0),
its coverage, selective risk and risk bound there, and the coverage and selective risk the
threshold gives on the held-out test split. A target no threshold can guarantee on these
answers is recorded with the fit's one-line reason. The same code as the command line
(``calm fit daca`` then ``calm fit threshold --adapter``); the bound is documented in
docs/methods.md §5. Writes ``results/threshold.{json,md}`` naming the command and commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from _common import command_line, git_commit, model_pair_parser

from calm_runtime.cli.common import install_named
from calm_runtime.data.models import resolve_model
from calm_runtime.errors import FitError
from calm_training.fit import fit_adapter
from calm_training.posthoc.fit_config import FitConfig

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("threshold")


def run(args) -> dict:
    model, reference = resolve_model(args.model), resolve_model(args.reference)
    base = FitConfig(model=str(model), data=args.data, reference=str(reference),
                     mode=args.mode, limit=args.limit, bootstrap=0, chat=False)
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="calm-threshold-") as tmp:
        adapters = {"vanilla": None}
        daca, report = fit_adapter(base, "daca", Path(tmp) / "daca", progress=not args.quiet)
        adapters["daca"] = str(Path(tmp) / "daca")
        daca_fit = report["fit"]
        for method, adapter in adapters.items():
            for risk in args.risk:
                config = dataclasses.replace(base, adapter=adapter, risk=risk,
                                             risk_confidence=args.confidence)
                out = Path(tmp) / f"{method}-{risk}"
                row = {"method": method, "risk": risk, "confidence": args.confidence}
                try:
                    _, fitted = fit_adapter(config, "threshold", out, progress=False)
                except FitError as exc:
                    row.update(threshold=None, reason=str(exc))
                else:
                    fit, test = fitted["fit"], fitted["test_split"]
                    row.update(threshold=fit["threshold"], calibration={
                        k: fit[k] for k in ("n", "n_kept", "coverage", "selective_risk",
                                            "risk_upper_bound")}, test=test)
                rows.append(row)
                logger.info("%s risk %g: %s", method, risk, row.get("threshold"))
    return {"provenance": {"command": args.command, "commit": args.commit,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "wall_s": round(time.perf_counter() - started, 1)},
            "config": {"model": args.model, "reference": args.reference, "data": args.data,
                       "mode": args.mode, "variant": base.variant, "limit": args.limit,
                       "calibration_fraction": base.calibration_fraction, "seed": base.seed},
            "daca": {"temperature": daca_fit.get("temperature"),
                     "agreement_rate": daca_fit.get("agreement_rate")},
            "rows": rows}


def markdown(payload: dict) -> str:
    p, c = payload["provenance"], payload["config"]
    lines = [f"`{p['command']}` at {p['commit']} ({p['date']}, {p['wall_s']:.0f} s); "
             f"{c['model']} on {c['data']} ({c['mode']}, {c['variant']} scores), "
             f"{c['calibration_fraction']:.0%} calibration split (seed {c['seed']}); DACA "
             f"against {c['reference']}: T = {payload['daca']['temperature']:.3f}, agreement "
             f"{payload['daca']['agreement_rate']:.2f}.", "",
             "| method | target risk | threshold | calibration coverage | calibration risk | "
             "risk bound | test coverage | test selective risk | test risk without abstention |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if r["threshold"] is None:
            lines.append(f"| {r['method']} | {r['risk']:g} | none | - | - | - | - | - | - |")
            continue
        cal, test = r["calibration"], r["test"]
        sel = test.get("selective_risk")
        lines.append(f"| {r['method']} | {r['risk']:g} | {r['threshold']:.2f} | "
                     f"{cal['coverage']:.3f} ({cal['n_kept']}/{cal['n']}) | "
                     f"{cal['selective_risk']:.3f} | {cal['risk_upper_bound']:.3f} | "
                     f"{test['coverage']:.3f} (n={test['n']}) | "
                     f"{'-' if sel is None else f'{sel:.3f}'} | "
                     f"{test['risk_without_abstention']:.3f} |")
    reasons = [f"* {r['method']}, risk {r['risk']:g}: {r['reason']}" for r in payload["rows"]
               if r["threshold"] is None]
    if reasons:
        lines += ["", "Targets no threshold guarantees on these answers:", "", *reasons]
    lines += ["", f"Risk bound: one-sided Clopper-Pearson at confidence "
              f"{payload['rows'][0]['confidence']:g}, Bonferroni over the fixed grid of "
              "thresholds (docs/methods.md §5)."]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = model_pair_parser(__doc__)
    parser.add_argument("--risk", type=float, nargs="+", default=[0.1, 0.3, 0.6])
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    args.command = command_line("threshold.py", argv)
    args.commit = git_commit()
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_named([args.model, args.reference], [args.data])  # a command line: it may install
    payload = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("threshold.json", json.dumps(payload, indent=1) + "\n"),
                       ("threshold.md", markdown(payload) + "\n")):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
    sys.stdout.write(markdown(payload) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
