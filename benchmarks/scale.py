"""The sizes users calibrate: peak memory and wall time of calm's commands on 0.5B and 1.2B
models, beside optimum-cli's and onnxruntime-genai's builder's export of the same folder.

    python benchmarks/scale.py                          # both models, every arm
    python benchmarks/scale.py --models m1 --arms export-fp32,builder-fp32
    python benchmarks/scale.py --optimum /path/to/optimum-venv/bin/optimum-cli
    python benchmarks/scale.py --render                 # rewrite the .md from the .json

The models are Llama-shaped with random weights, made reproducibly from ``--seed`` (memory
and time depend on the shapes, not on the values) and saved in bfloat16 with SmolLM2's
tokenizer files beside them (``calm models install smollm2-135m-instruct`` first):

* ``m1``: 24 layers, hidden 1024, untied head, vocabulary 49,152 (about 0.46B parameters);
* ``m2``: Llama-3.2-1B's shape, 16 layers, hidden 2048, GQA 32/8, tied head, vocabulary
  128,256 (1.24B parameters); its config's vocabulary is larger than the tokenizer's, as in
  padded heads.

Each arm is one child process (``calm fit daca`` at float32 and bfloat16 against SmolLM2,
``calm-export`` at fp32 with the builder graph and with calm's own, fp16, int4, ``calm
generate`` on the fp32 engine, optimum-cli's and the builder's exports), timed alone; its
peak resident set size comes from ``wait4`` (the child and everything it waited for; for
calm-export, the largest of the windows it keeps per stage), its CPU time likewise.
Scores are not cached between arms: every arm runs with a fresh ``$CALM_CACHE`` whose
``models`` and ``data`` link to the current one. An arm that fails is recorded with its
last error line, never dropped. Writes ``results/scale.{json,md}`` after every arm, naming
each run's command and commit (``--update`` keeps what the file holds and replaces only what the run
measures); docs/results.md's section is rendered from the json. An arm whose peak, at the
rate it reached on the other model, would pass 90% of the machine's memory is skipped and
says so.

optimum's exporter needs an environment of its own (optimum-onnx 0.1 pins transformers
4.57): pass its ``optimum-cli`` with ``--optimum`` (or ``$CALM_OPTIMUM``); without one that
arm is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import command_line, git_commit
from _common import machine as common_machine

HERE = Path(__file__).resolve().parent
STEM = "scale"

#: the synthetic models: LlamaConfig keywords (max_position_embeddings kept small: the
#: rotary tables do not matter here)
MODELS = {
    "m1": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
           "num_key_value_heads": 4, "intermediate_size": 4096, "vocab_size": 49152,
           "tie_word_embeddings": False},
    "m2": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
           "tie_word_embeddings": True},
}
#: arm -> (what it measures, the target dtype its weights are counted in)
ARMS = {
    "fit-float32": ("calm fit daca --dtype float32 (reference: SmolLM2-135M)", "float32"),
    "fit-bfloat16": ("calm fit daca --dtype bfloat16 (reference: SmolLM2-135M)", "bfloat16"),
    "export-fp32": ("calm-export (default graph: the builder's)", "float32"),
    "export-fp32-fused": ("calm-export --graph fused (calm's own graph)", "float32"),
    "export-fp16": ("calm-export --dtype fp16", "float16"),
    "export-int4": ("calm-export --quantize int4", "int4"),
    "generate": ("calm generate, 16 tokens, on the fp32 engine", "float32"),
    "optimum-fp32": ("optimum-cli export onnx --task text-generation-with-past", "float32"),
    "builder-fp32": ("onnxruntime_genai.models.builder -p fp32 -e cpu", "float32"),
    "builder-fp16": ("onnxruntime_genai.models.builder -p fp16 -e cpu", "float16"),
    "builder-int4": ("onnxruntime_genai.models.builder -p int4 -e cpu", "int4"),
}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int4": 0.5}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")
PROMPT = "Question: What gas do plants absorb from the air?\nAnswer:"


def make_model(name: str, folder: Path, seed: int, tokenizer_folder: Path) -> int:
    """Write model ``name`` into ``folder`` (bfloat16 safetensors and SmolLM2's tokenizer)
    unless it is there from the same seed; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = folder / "scale_model.json"
    if stamp.is_file():
        saved = json.loads(stamp.read_text())
        if saved.get("seed") == seed and saved.get("config") == MODELS[name] \
                and saved.get("initializer_range") == 0.1:
            return saved["parameters"]
    shutil.rmtree(folder, ignore_errors=True)
    # initializer 0.1: outputs far enough from uniform that the fit arms' DACA has answers
    # to agree on (at 0.02 every option scores alike)
    config = LlamaConfig(**MODELS[name], max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, initializer_range=0.1)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # never a float32 copy of the weights
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(folder))
    del model
    for file in TOKENIZER_FILES:
        if (tokenizer_folder / file).is_file():
            shutil.copy(tokenizer_folder / file, folder / file)
    stamp.write_text(json.dumps({"seed": seed, "config": MODELS[name], "initializer_range": 0.1,
                                 "parameters": parameters}, indent=2) + "\n")
    return parameters


def run_child(command: list[str], env: dict, log: Path, timeout: float) -> dict:
    """Run ``command`` alone; its wall time, CPU time and peak RSS (``wait4``)."""
    start = time.perf_counter()
    with open(log, "w") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                pid, status, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.2)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    error = None
    if child.returncode != 0:
        error = next((line for line in reversed(lines) if "Error" in line or "error" in line),
                     lines[-1] if lines else "no output")[:300]
    return {"rc": child.returncode, "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 0), "error": error,
            "timed_out": wall > timeout}


def arm_command(arm: str, model: Path, work: Path, args) -> list[str] | None:
    calm_bin = Path(sys.executable).parent
    calm, export = str(calm_bin / "calm"), str(calm_bin / "calm-export")
    out = work / arm
    if arm.startswith("fit-"):
        # DACA against a real reference: labels would give random weights an infinite
        # temperature (their scores carry no signal); the reference's confidence is finite
        return [calm, "fit", "daca", "--model", str(model), "--reference", args.reference,
                "--data", args.data, "--limit", str(args.limit), "--dtype",
                arm.rsplit("-", 1)[1], "--device", "cpu", "--out", str(out), "-q"]
    if arm.startswith("export-"):
        extra = {"export-fp32": [], "export-fp32-fused": ["--graph", "fused"],
                 "export-fp16": ["--dtype", "fp16"], "export-int4": ["--quantize", "int4",
                                                                     "--int4-blocks",
                                                                     "requantize"]}[arm]
        return [export, "--model", str(model), "--out", str(out), "--device", "cpu", *extra]
    if arm == "generate":
        engine = work / "export-fp32"
        if not (engine / "calm_engine.json").is_file():
            return None
        return [calm, "generate", str(engine), PROMPT, "--max-new-tokens", "16", "--json"]
    if arm == "optimum-fp32":
        if not args.optimum:
            return None
        return [args.optimum, "export", "onnx", "--model", str(model), "--task",
                "text-generation-with-past", str(out)]
    if arm.startswith("builder-"):
        precision = arm.split("-", 1)[1]
        return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-m", "scale",
                "-i", str(model), "-o", str(out), "-p", precision, "-e", "cpu", "-c",
                str(work / f"{arm}-cache")]
    raise ValueError(arm)


def fresh_cache(root: Path) -> Path:
    """A ``$CALM_CACHE`` whose models and data are the current cache's (nothing scored)."""
    from calm_runtime.paths import cache_dir

    cache = root / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    for name in ("models", "data"):
        source = Path(cache_dir()) / name
        if source.is_dir():
            (cache / name).symlink_to(source)
    return cache


def machine_memory_mb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e6


def predicted_peak_mb(result: dict, arm: str, parameters: int) -> float | None:
    """The peak ``arm`` would reach on ``parameters`` at the largest rate (MB per parameter)
    it reached on another model already measured, or ``None``."""
    rates = [m["arms"][arm]["peak_rss_mb"] / m["parameters"]
             for m in result["models"].values()
             if m["parameters"] != parameters and "peak_rss_mb" in m["arms"].get(arm, {})]
    return max(rates) * parameters if rates else None


def measure(args, data: dict, save) -> None:
    """Run the arms into ``data["models"]`` (kept from an earlier file with ``--update``),
    calling ``save()`` after each arm so that a long run loses nothing when stopped."""
    from calm_runtime.data.models import resolve_model

    tokenizer_folder = resolve_model("smollm2-135m-instruct")
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a] if args.arms else list(ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    run = len(data["runs"]) - 1
    budget = 0.9 * machine_memory_mb()
    for name in args.models.split(","):
        folder = root / f"model-{name}"
        print(f"[scale] making {name} in {folder}", flush=True)
        parameters = make_model(name, folder, args.seed, tokenizer_folder)
        entry = data["models"].setdefault(name, {"arms": {}})
        entry.update({"config": MODELS[name], "parameters": parameters,
                      "weights_mb": {dtype: round(parameters * size / 1e6)
                                     for dtype, size in BYTES.items()}})
        entry["arms"] = {a: entry["arms"][a] for a in ARMS if a in entry["arms"]}
        work = root / f"runs-{name}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        for arm in arms:
            command = arm_command(arm, folder, work, args)
            predicted = predicted_peak_mb(data, arm, parameters)
            why = None
            if command is None:
                why = ("no --optimum given" if arm.startswith("optimum") else
                       "the fp32 engine was not built")
            elif predicted is not None and predicted > budget:
                why = (f"would need about {predicted / 1e3:.0f} GB at the rate measured on the "
                       f"other model, more than 90% of this machine's "
                       f"{machine_memory_mb() / 1e3:.0f} GB")
            if why is not None:
                entry["arms"][arm] = {"skipped": why, "run": run}
                print(f"[scale] {name} {arm}: skipped ({why})", flush=True)
                save()
                continue
            env = dict(os.environ, CALM_CACHE=str(fresh_cache(root)), HF_HUB_OFFLINE="1",
                       TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
            print(f"[scale] {name} {arm}: {' '.join(command[-6:])}", flush=True)
            record = run_child(command, env, work / f"{arm}.log", args.timeout)
            record["what"], record["dtype"] = ARMS[arm]
            record["run"] = run
            weights = parameters * BYTES[ARMS[arm][1]] / 1e6
            manifest = work / arm / "calm_engine.json"
            if manifest.is_file():
                export = json.loads(manifest.read_text())["export"]
                stages = export.get("stages") or {}
                record["stages"], record["graph"] = stages, export["graph"]["kind"]
                if stages.get("peak_rss_mb"):
                    # calm-export starts a peak window per stage (export/progress.py), which
                    # the kernel's lifetime peak that wait4 reads does not survive: the
                    # process's peak is the largest window's
                    record["peak_rss_mb_wait4"] = record["peak_rss_mb"]
                    record["peak_rss_mb"] = max(max(stages["peak_rss_mb"].values()),
                                                record["peak_rss_mb"])
                    record["peak_from"] = "calm-export's per-stage VmHWM windows"
            elif arm.startswith("export-"):
                record["peak_from"] = ("wait4 (no manifest: calm-export's per-stage windows "
                                       "were lost with the failed export, so this is the "
                                       "last window's peak, a lower bound)")
            if arm == "generate" and record["rc"] == 0:
                record["decode"] = generated(work / f"{arm}.log")
            record["peak_over_weights"] = round(record["peak_rss_mb"] / weights, 2)
            entry["arms"][arm] = record
            print(f"[scale] {name} {arm}: rc {record['rc']}, {record['wall_s']} s, peak "
                  f"{record['peak_rss_mb']:.0f} MB ({record['peak_over_weights']}x the "
                  f"{record['dtype']} weights)" + (f"; {record['error']}" if record["error"]
                                                   else ""), flush=True)
            if arm != "export-fp32" and not args.keep:
                shutil.rmtree(work / arm, ignore_errors=True)
                shutil.rmtree(work / f"{arm}-cache", ignore_errors=True)
            ratios(entry)
            save()
        if not args.keep:
            shutil.rmtree(work / "export-fp32", ignore_errors=True)


def ratios(entry: dict) -> None:
    """Each export arm's wall time over optimum-cli's, where both ran in the same run."""
    optimum = entry["arms"].get("optimum-fp32", {})
    for arm, record in entry["arms"].items():
        if (optimum.get("rc") == 0 and arm.startswith("export-") and "wall_s" in record
                and record.get("run") == optimum.get("run")):
            record["wall_over_optimum"] = round(record["wall_s"] / optimum["wall_s"], 2)
        else:
            record.pop("wall_over_optimum", None)


def generated(log: Path) -> dict:
    """What ``calm generate --json`` said of its tokens: how many, how many rendered empty,
    and the time per token."""
    text = log.read_text(errors="replace")
    try:
        out = json.loads(text[text.index("{"):])
    except ValueError:
        return {}
    tokens = out.get("tokens", [])
    return {"tokens": len(tokens), "empty": sum(1 for t in tokens if not t.get("text")),
            "per_token_s": (out.get("timing") or {}).get("per_token_s")}


def machine() -> dict:
    """:func:`_common.machine`, with the memory in GB and the Python version."""
    return {**common_machine(), "memory_gb": round(machine_memory_mb() / 1e3, 1),
            "python": platform.python_version()}


def fits_24gb(result: dict) -> list[str]:
    """What a 24 GB machine fits, read from the measured peaks (linear in the parameters
    between and beyond the two models, from each arm's bytes per parameter)."""
    lines = []
    for arm in ARMS:
        per_param = [r["arms"][arm]["peak_rss_mb"] / r["parameters"]
                     for r in result["models"].values()
                     if r["arms"].get(arm, {}).get("rc") == 0]
        if not per_param:
            continue
        largest = 24e3 / max(per_param) / 1e9  # MB per parameter -> billions of parameters
        lines.append(f"{arm}: about {largest:.1f}B parameters")
    return lines


def describe(model: dict) -> str:
    """A model's size and shape in one line, as both pages give it."""
    c = model["config"]
    return (f"{model['parameters'] / 1e6:,.0f}M parameters (hidden {c['hidden_size']}, "
            f"{c['num_hidden_layers']} layers, vocabulary {c['vocab_size']:,}, "
            f"{'tied' if c['tie_word_embeddings'] else 'untied'} head; "
            f"{model['weights_mb']['float32']:,} MB in float32, "
            f"{model['weights_mb']['bfloat16']:,} MB in 16 bits)")


def render(data: dict) -> str:
    first = data["runs"][0]["machine"]
    lines = ["# calm at the sizes users calibrate", "",
             "Runs (each arm names the run that measured it):", ""]
    lines += [f"{i}. `{r['command']}` at {r['commit']}" for i, r in enumerate(data["runs"])]
    lines += ["", f"Machine: {first['cores']} cores, {first['cpu']}, {first['memory_gb']} GB. "
              "Peak RSS per child process (wait4; calm-export: the largest of its per-stage "
              "windows); wall time of the child. Weights counted in each arm's target dtype "
              "(int4: half a byte per parameter). Wall over optimum only between arms of the "
              "same run.", ""]
    for name, model in data["models"].items():
        lines += [f"## {name}: {describe(model)}", "",
                  "| arm | what | run | rc | wall s | CPU s | peak RSS MB | peak / weights | "
                  "wall / optimum |", "|---|---|---|---|---|---|---|---|---|"]
        for arm, r in model["arms"].items():
            if "skipped" in r:
                lines.append(f"| {arm} | {ARMS[arm][0]} | {r['run']} | skipped: "
                             f"{r['skipped']} | | | | | |")
                continue
            lines.append(f"| {arm} | {r['what']} | {r['run']} | {r['rc']} | {r['wall_s']} | "
                         f"{r['cpu_s']} | {r['peak_rss_mb']:,.0f} | {r['peak_over_weights']} | "
                         f"{r.get('wall_over_optimum', '')} |")
        failed = [(arm, r["error"]) for arm, r in model["arms"].items() if r.get("error")]
        if failed:
            lines += [""] + [f"- {arm} failed: `{error}`" for arm, error in failed]
        decode = model["arms"].get("generate", {}).get("decode")
        if decode:
            lines += ["", f"calm generate: {decode['tokens']} tokens, {decode['empty']} of them "
                      "rendering empty, "
                      f"{decode['per_token_s'] * 1e3:.1f} ms per token."]
        staged = {arm: r["stages"] for arm, r in model["arms"].items() if r.get("stages")}
        if staged:
            lines += ["", "calm-export's own per-stage peaks (MB, from the manifest):", ""]
            for arm, stages in staged.items():
                lines.append(f"- {arm}: " + ", ".join(
                    f"{k} {v:,.0f}" for k, v in stages.get("peak_rss_mb", {}).items()))
        lines.append("")
    lines += ["## What a 24 GB machine fits", "",
              "Each arm's peak per parameter, at the larger of the two models' rates:", ""]
    lines += [f"- {line}" for line in data["fits_24gb"]]
    return "\n".join(lines) + "\n"


def results_section(data: dict) -> list[str]:
    """docs/results.md's section (benchmarks/render_results.py): each model's arms, peak
    memory against the weights, wall time against optimum-cli's, what a 24 GB machine
    fits."""
    runs = "; ".join(f"run {i}: `{r['command']}` at {r['commit']}"
                     for i, r in enumerate(data["runs"]))
    machine = data["runs"][0]["machine"]
    lines = ["## The sizes users calibrate", "",
             f"From `benchmarks/results/scale.json` ({runs}; each arm names its run) on "
             f"{machine['cores']} cores and {machine['memory_gb']} GB: Llama-shaped models "
             "with random weights "
             "(memory and time depend on the shapes), each arm a child process run alone, its "
             "peak resident set size against the weights in the arm's target precision, its "
             "wall time against optimum-cli's export of the same folder.", ""]
    for name, model in data["models"].items():
        lines += [f"**{name}**: {describe(model)}.", "",
                  "| arm | what | run | result | wall s | peak RSS MB | peak / weights | "
                  "wall / optimum |", "|---|---|---|---|---|---|---|---|"]
        for arm, r in model["arms"].items():
            if "skipped" in r:
                lines.append(f"| {arm} | | {r['run']} | skipped: {r['skipped']} | | | | |")
                continue
            result = "ok" if r["rc"] == 0 else (
                "killed (out of memory)" if r["rc"] in (-9, 137) else f"failed (exit {r['rc']})")
            lines.append(f"| {arm} | {r['what']} | {r['run']} | {result} | {r['wall_s']:g} | "
                         f"{r['peak_rss_mb']:,.0f} | {r['peak_over_weights']:g} | "
                         f"{r.get('wall_over_optimum', '')} |")
        failed = [(arm, r["error"]) for arm, r in model["arms"].items()
                  if r.get("error") and r.get("rc") not in (-9, 137)]
        lines += [""] + [f"- {arm}: `{error}`" for arm, error in failed] + ([""] if failed
                                                                             else [])
    lines += ["What a 24 GB machine fits, at each arm's measured peak per parameter (the larger "
              "of the two models' rates; linear in the parameters):", ""]
    lines += [f"- {line}" for line in data["fits_24gb"]] + [""]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="m1,m2", help="m1, m2 or both (default)")
    parser.add_argument("--arms", default=None,
                        help=f"comma-separated arms (default all: {', '.join(ARMS)})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--data", default="arc-easy", help="data of the fit arms")
    parser.add_argument("--limit", type=int, default=100, help="questions of the fit arms")
    parser.add_argument("--reference", default="smollm2-135m-instruct",
                        help="the fit arms' DACA reference")
    parser.add_argument("--optimum", default=os.environ.get("CALM_OPTIMUM"),
                        help="optimum-cli of an environment with optimum-onnx")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "calm-scale"),
                        help="where the models and engines are made (about 15 GB free)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per arm")
    parser.add_argument("--keep", action="store_true", help="keep every arm's output")
    parser.add_argument("--update", action="store_true",
                        help="keep the result file's other models and arms, replacing only "
                             "what this run measures (each arm names its run)")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--render", action="store_true",
                        help="only recompute what is derived from the measurements (the 24 GB "
                             "lines) and rewrite the .md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.render:  # the derived lines recomputed from the measurements, then the page
        data = json.loads((out / f"{STEM}.json").read_text())
        data["fits_24gb"] = fits_24gb(data)
        (out / f"{STEM}.json").write_text(json.dumps(data, indent=2) + "\n")
        (out / f"{STEM}.md").write_text(render(data))
        return 0
    path = out / f"{STEM}.json"
    data = {"runs": [], "models": {}}
    if args.update and path.is_file():
        data = json.loads(path.read_text())
    data["runs"].append({"command": command_line("scale.py", argv), "commit": git_commit(),
                         "machine": machine(), "models": args.models,
                         "arms": args.arms or "all"})
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        data["fits_24gb"] = fits_24gb(data)
        path.write_text(json.dumps(data, indent=2) + "\n")
        (out / f"{STEM}.md").write_text(render(data))

    measure(args, data, save)
    save()
    print(f"wrote {out / STEM}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
