"""Calibrating from lm-evaluation-harness sample logs: the same fits as from calm's own scoring.

    python benchmarks/lm_eval_logs.py --lm-eval PATH/TO/lm_eval
        [--model smollm2-135m-instruct] [--reference gemma-3-270m] [--data arc-easy]

For the model and its reference in turn, on every question of ``--data``:

1. **The harness**: ``lm_eval --log_samples`` (its ``hf`` backend, float32, batch 8, offline)
   on a local ``multiple_choice`` task whose prompt is calm's cloze prompt
   (``Question: {q}\\nAnswer:`` + ``" {option}"``). Its wall time is the whole process; its
   log-likelihood phase is read from its own progress bar.
2. **calm's scorer** on the same questions (the model loaded, every option scored, each
   question's context once with its KV cache shared by the options), timed in this process.
   The largest per-option difference between the two and the argmax agreement are reported.
3. **The fits**: ``calm fit daca`` and ``calm fit ts`` (``sum`` and ``mean`` option scores)
   and ``calm eval --compare``, once from calm's own scoring and once from the two logs
   (``--model-scores lm-eval:… --reference-scores lm-eval:…``). The log runs get folders
   holding each model's config and tokenizer only, no weights, so that nothing can run
   either model; the ``mean`` variant counts the continuations' tokens with the tokenizer.
   The temperatures and every number of the two eval tables are compared.

The harness and calm's scorer are timed one after the other on the same machine; run it
on a quiet one. Writes ``results/lm_eval_logs.json`` and ``lm_eval_logs.md``
(``python benchmarks/render_results.py`` then shows it in docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import command_line, git_commit, portable

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("lm_eval_logs")

#: the files of a model folder that are not its weights (a tokenizer-only copy keeps these)
WEIGHTS = re.compile(r"\.(safetensors|bin|pt|pth|gguf|onnx)$|\.index\.json$")
#: the harness's log-likelihood progress bar, "... 2281/2281 [02:43<00:00, ...]"
PHASE = re.compile(r"Running loglikelihood requests.*?(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<",
                   re.S)
#: temperatures from logs and from calm's own scoring agree to this
TOLERANCE = 1e-3


def run_harness(lm_eval: str, folder: Path, data: Path, root: Path, batch_size: int) -> dict:
    """``lm_eval --log_samples`` on ``data`` with the model in ``folder``: the samples file,
    the process's wall time and its log-likelihood phase (from its progress bar)."""
    from calm_training.scoring.lm_eval_logs import cloze_task

    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "calm_mc.yaml").write_text(cloze_task("calm_mc", data))
    command = [lm_eval, "--model", "hf", "--model_args",
               f"pretrained={folder},dtype=float32", "--tasks", "calm_mc", "--include_path",
               str(tasks), "--device", "cpu", "--batch_size", str(batch_size), "--log_samples",
               "--output_path", str(root / "out")]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed ({done.returncode}): {done.stderr[-2000:]}")
    found = sorted((root / "out").rglob("samples_calm_mc_*.jsonl"))
    phase = PHASE.findall(done.stderr + done.stdout)
    seconds = None
    if phase:
        _, _, hours, minutes, secs = phase[-1]
        seconds = int(hours or 0) * 3600 + int(minutes) * 60 + int(secs)
    return {"log": found[-1], "wall_s": round(wall, 1), "loglikelihood_s": seconds}


def calm_scores(folder: Path, records, batch_size: int) -> tuple[np.ndarray, float]:
    """calm's cloze sums of ``records`` by the model in ``folder`` and the seconds it took
    (loading included)."""
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_training.scoring.local import score_multiple_choice

    started = time.perf_counter()
    model, tokenizer, _ = load_model_and_tokenizer(folder)
    scores = score_multiple_choice(model, tokenizer, records, mode="cloze",
                                   batch_size=batch_size, progress=False)
    return scores.values, time.perf_counter() - started


def tokenizer_only(folder: Path, out: Path) -> Path:
    """A copy of ``folder`` without its weights: what a fit from logs may read."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in folder.iterdir():
        if path.is_file() and not WEIGHTS.search(path.name):
            shutil.copy2(path, out / path.name)
    return out


def calm_cli(*args: str, env: dict) -> float:
    started = time.perf_counter()
    calm = Path(sys.executable).with_name("calm")
    done = subprocess.run([str(calm), *args, "-q"], env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"calm {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def _fit(adapter: Path) -> dict:
    """The answer temperature ``calm fit`` wrote, and the token-level one when it fitted it."""
    method = json.loads((adapter / "calm_adapter.json").read_text())["method"]
    token = method.get("token_fit") or {}
    return {"temperature": float(method["fit"]["temperature"]),
            "token_temperature": token.get("temperature") if token.get("fitted") else None,
            "token_fit_reason": None if token.get("fitted") else token.get("reason")}


#: the `calm fit` runs of each source: (label, method, extra flags); from calm's own scoring
#: `calm fit ts` fits a token-level T first unless --no-token-fit (a log holds no next-token
#: distributions, so a fit from logs is answer-only)
FITS = {"own": (("daca", "daca", ()), ("ts", "ts", ()),
                ("ts --no-token-fit", "ts", ("--no-token-fit",))),
        "logs": (("daca", "daca", ()), ("ts", "ts", ()))}
#: (own label, logs label): the same fit both ways
SAME_FIT = (("daca", "daca"), ("ts --no-token-fit", "ts"))
#: what an eval table's row holds that is solver bookkeeping, not a result
BOOKKEEPING = ("fit.iterations", "fit.objective")


def _table(report_dir: Path) -> dict:
    """``{method: {metric: value}}`` of the one eval report in ``report_dir``."""
    report = json.loads(next(report_dir.glob("*.json")).read_text())
    out = {}
    for name, row in report["methods"].items():
        if "error" in row:
            continue
        flat = {k: v for k, v in row.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        flat |= {f"ece_ci.{i}": v for i, v in enumerate(row.get("ece_ci") or [])}
        flat |= {f"fit.{k}": v for k, v in (row.get("fit") or {}).items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[name] = {k: v for k, v in flat.items() if k not in BOOKKEEPING}
    return out


def fits(args, folders: dict, logs: dict, root: Path) -> dict:
    """``calm fit daca/ts`` and ``calm eval --compare`` from calm's own scoring and from the
    logs (tokenizer-only folders), for the ``sum`` and ``mean`` variants."""
    env = {**os.environ}
    bare = {role: tokenizer_only(folder, root / "tokenizer-only" / role)
            for role, folder in folders.items()}
    out = {}
    for variant in ("sum", "mean"):
        row = {}
        for source in ("own", "logs"):
            given = (["--model", str(folders["model"]), "--reference",
                      str(folders["reference"]), "--data", args.data] if source == "own" else
                     ["--model", str(bare["model"]), "--reference", str(bare["reference"]),
                      "--model-scores", f"lm-eval:{logs['model']}",
                      "--reference-scores", f"lm-eval:{logs['reference']}"])
            given += ["--variant", variant]
            found = {}
            for label, method, extra in FITS[source]:
                adapter = root / "adapters" / f"{source}-{variant}-{label.replace(' ', '')}"
                seconds = calm_cli("fit", method, *given, *extra, "--out", str(adapter),
                                   "--overwrite", env=env)
                found[label] = {**_fit(adapter), "s": round(seconds, 1)}
            reports = root / "reports" / f"{source}-{variant}"
            shutil.rmtree(reports, ignore_errors=True)
            seconds = calm_cli("eval", *given, "--compare", "--report-dir", str(reports),
                               env=env)
            found["eval"] = {"table": _table(reports), "s": round(seconds, 1)}
            row[source] = found
        own, logs_ = row["own"]["eval"]["table"], row["logs"]["eval"]["table"]
        diffs = [abs(v - logs_[m][k]) for m, values in own.items() for k, v in values.items()
                 if k in logs_.get(m, {}) and np.isfinite(v) and np.isfinite(logs_[m][k])]
        row["eval_max_diff"] = float(max(diffs)) if diffs else None
        row["eval_same_methods"] = sorted(own) == sorted(logs_)
        # the same fit both ways: every answer temperature of the eval tables, and each
        # `calm fit` adapter where calm's own scoring fitted no token-level T before it
        # (a log holds option sums, not the next-token distributions a token fit needs)
        same = {f"eval {m}": abs(own[m]["fit.temperature"] - logs_[m]["fit.temperature"])
                for m in own if "fit.temperature" in own[m] and m in logs_}
        same |= {f"calm fit {m}": abs(row["own"][o]["temperature"] - row["logs"][m]["temperature"])
                 for o, m in SAME_FIT if row["own"][o]["token_temperature"] is None}
        row["same_fit_diff"] = same
        out[variant] = row
    return out


def render(payload: dict) -> str:
    limited = f" (the first {payload['limit']} only)" if payload.get("limit") else ""
    earlier = payload.get("scoring_from")
    scored = (f" The scores, logs and timings are those of `{earlier['command']}` (commit "
              f"{earlier['commit']})." if earlier else "")
    lines = [f"Generated by `{payload['command']}` (commit {payload['commit']}): "
             f"{payload['data']} ({payload['n']} questions{limited}, {payload['n_options']} "
             f"options), lm-evaluation-harness {payload['harness_version']} (`hf` backend, "
             f"float32, batch {payload['batch_size']}) against calm's cloze scorer on the same "
             f"machine, one after the other.{scored}", "",
             "| model | harness wall s | harness log-likelihood phase s | calm scorer s "
             "(load + score) | harness / calm | max abs(calm − harness) per option | same "
             "argmax |", "|---|---|---|---|---|---|---|"]
    for role, s in payload["scoring"].items():
        phase = s["harness"]["loglikelihood_s"]
        lines.append(f"| {s['model']} ({role}) | {s['harness']['wall_s']:.1f} | "
                     f"{'-' if phase is None else phase} | {s['calm_s']:.1f} | "
                     f"{s['harness']['wall_s'] / s['calm_s']:.2f}x | {s['max_abs_diff']:.1e} | "
                     f"{s['same_argmax']}/{payload['n']} |")
    lines += ["", "Fits from the two logs (model folders holding config and tokenizer only, "
              "no weights) against the fits from calm's own scoring: the temperatures each "
              "`calm fit` wrote. From its own scoring `calm fit ts` fits a token-level "
              "temperature first (on the next-token distributions, which a log does not "
              "hold) and its answer temperature on top of it; `--no-token-fit` is the "
              "answer-only fit a log allows.", "",
              "| variant | calm fit (own scoring) | answer T | token T | calm fit (logs) | "
              "answer T | fit from logs s |", "|---|---|---|---|---|---|---|"]
    for variant, row in payload["fits"].items():
        for label, _, _ in FITS["own"]:
            own, token = row["own"][label], row["own"][label]["token_temperature"]
            pair = dict(SAME_FIT).get(label)
            logs = row["logs"].get(pair) if pair else None
            lines.append(f"| {variant} | {label} | {own['temperature']:.6f} | "
                         f"{'-' if token is None else format(token, '.4f')} | "
                         + (f"{pair} | {logs['temperature']:.6f} | {logs['s']:.1f} |" if logs
                            else "- | - | - |"))
    lines += ["", "The same fit both ways (`calm eval --compare`'s naive, DACA and TS answer "
              "temperatures; `calm fit daca`; `calm fit ts --no-token-fit` against `calm fit "
              "ts` from the logs), largest absolute "
              "difference, and the largest difference between any two numbers of the two "
              "`calm eval --compare` tables (accuracy, ECE and its interval, MCE, AECE, "
              "Brier, NLL, fitted parameters; solver iteration counts left out):", ""]
    for variant, row in payload["fits"].items():
        worst = max(row["same_fit_diff"].items(), key=lambda kv: kv[1])
        lines.append(f"- {variant}: temperatures {worst[1]:.1e} (largest: {worst[0]}); "
                     f"tables {row['eval_max_diff']:.1e}, same methods "
                     f"{row['eval_same_methods']}.")
    lines += ["", f"Temperatures of the same fit within {TOLERANCE:g}: **{payload['verdict']}**."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pip install 'lm_eval[hf]==0.4.13'  # in an environment of its own\n"
               "  python benchmarks/lm_eval_logs.py --lm-eval ENV/bin/lm_eval")
    parser.add_argument("--lm-eval", default=os.environ.get("CALM_LM_EVAL")
                        or shutil.which("lm_eval"),
                        help="the lm_eval command (default: $CALM_LM_EVAL, else on PATH)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--reference", default="gemma-3-270m")
    parser.add_argument("--data", default="arc-easy")
    parser.add_argument("--limit", type=int, default=None,
                        help="the first N questions only (a quick check; the result files "
                             "say so)")
    parser.add_argument("--fits-only", action="store_true",
                        help="redo the fits only, from the harness logs an earlier run left "
                             "in --work (its timings and score comparison are kept, and the "
                             "result file names that run)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--work", type=Path, default=None,
                        help="where logs, adapters and reports go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.lm_eval:
        parser.error("no lm_eval found: pass --lm-eval PATH (pip install 'lm_eval[hf]')")
    from calm_runtime.data.models import install_model
    from calm_runtime.data.sets import install_dataset, load_dataset
    from calm_training.scoring.lm_eval_logs import read_samples

    data = Path(install_dataset(args.data))
    records = load_dataset(args.data)
    folders = {"model": Path(install_model(args.model)),
               "reference": Path(install_model(args.reference))}
    root = args.work or Path(tempfile.mkdtemp(prefix="calm-lm-eval-"))
    if args.limit:  # the first N questions, one file for the harness and for calm
        records = records[:args.limit]
        lines = data.read_text().splitlines()[:args.limit]
        data = root / f"{args.data}-{args.limit}.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        data.write_text("\n".join(lines) + "\n")
        args.data = str(data)
    version = subprocess.run([str(Path(args.lm_eval).with_name("python")), "-c",
                              "import importlib.metadata as m; print(m.version('lm_eval'))"],
                             capture_output=True, text=True, check=False).stdout.strip()
    scoring, logs, earlier = {}, {}, None
    if args.fits_only:  # the harness's logs and the timings of an earlier run in --work
        earlier = json.loads((args.out / "lm_eval_logs.json").read_text())
        scoring = earlier["scoring"]
        for role in folders:
            found = sorted((root / "harness" / role / "out").rglob("samples_calm_mc_*.jsonl"))
            if not found:
                parser.error(f"--fits-only: no harness log under {root / 'harness' / role}; "
                             "run without --fits-only first (with the same --work)")
            logs[role] = found[-1]
    for role, folder in folders.items():
        if args.fits_only:
            break
        logger.info("%s: the harness", role)
        harness = run_harness(args.lm_eval, folder, data, root / "harness" / role,
                              args.batch_size)
        logger.info("%s: calm's scorer", role)
        ours, seconds = calm_scores(folder, records, args.batch_size)
        log = read_samples(harness["log"])
        logs[role] = harness["log"]
        both = np.isfinite(ours)
        scoring[role] = {
            "model": args.model if role == "model" else args.reference,
            "harness": {k: v for k, v in harness.items() if k != "log"},
            "calm_s": round(seconds, 1),
            "max_abs_diff": float(np.max(np.abs(log.sums[both] - ours[both]))),
            "same_argmax": int((np.nanargmax(np.where(both, log.sums, -np.inf), axis=1)
                                == np.nanargmax(np.where(both, ours, -np.inf), axis=1)).sum())}
    fitted = fits(args, folders, logs, root)
    worst = max(d for row in fitted.values() for d in row["same_fit_diff"].values())
    payload = {"command": portable(command_line("lm_eval_logs.py", argv)),
               "commit": git_commit(), "data": args.data, "n": len(records),
               "n_options": sorted({len(r.choices) for r in records}),
               "harness_version": version or "unknown", "batch_size": args.batch_size,
               "limit": args.limit, "scoring": scoring, "fits": fitted,
               "largest_temperature_diff": worst,
               "verdict": "holds" if worst <= TOLERANCE else "refuted"}
    if earlier is not None:  # the scoring table is the earlier run's
        payload["scoring_from"] = earlier.get("scoring_from") or {
            "command": earlier["command"], "commit": earlier["commit"]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_eval_logs.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = render(payload)
    (args.out / "lm_eval_logs.md").write_text(text + "\n")
    logger.info("%s", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
