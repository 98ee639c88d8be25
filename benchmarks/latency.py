"""Latency benchmark: calm's runtime against its baselines and peers, one process, one model.

    python benchmarks/latency.py --engine ENGINE [--identity-engine ENGINE] [--int8-engine ENGINE]
        [--adapter ADAPTER] [--threads 1] [--batches 1 8] [--tokens 32] [--rounds 3]
        [--device cpu|cuda] [--prefill-engine ENGINE --prefill-model MODEL --prefill-tokens 512]

Contenders run in a fresh random order (seeded) every round, so machine noise and
after-effects of the previous contender (torch's spinning threads, evicted caches) hit all
alike; read the ratios, absolute times drift on shared machines. Each is greedy,
``--tokens`` new tokens per row:

* ``transformers``: ``model.generate()`` on the source model in torch;
* ``calm-torch``: :class:`~calm_runtime.CalibratedLM`'s torch backend (source model + adapter);
* ``calm-onnxruntime``: ``CalibratedLM`` on the fused engine: calibrated token confidences,
  entropies and incremental detokenization, what a server returns;
* ``ort-loop``: the same engine and KV-cache loop with argmax only — no confidences, no
  text (the floor of any runtime on this engine); ``calm-onnxruntime`` / ``ort-loop`` is
  what calm's per-token work costs;
* ``calm-onnxruntime-uncalibrated``: ``CalibratedLM`` on ``--identity-engine`` (the same
  model exported without calibration): fused / uncalibrated is what fusing costs;
* ``ort-loop-unfused-numpy`` vs ``ort-loop-fused``: the loop with confidences, once on the
  uncalibrated engine with the calibration applied per step in numpy
  (``apply_calibration`` with the adapter's τ, l, T) and once on the fused engine;
* ``calm-onnxruntime-int8``: ``CalibratedLM`` on ``--int8-engine``;
* ``onnxruntime-genai``: the fused engine folder run by onnxruntime-genai (the peer).

For batch 1 and 8 (the prompt repeated, so every row decodes every step): prefill, the
per-step decode time (a step yields one token per row; each round gives one mean over its
steps) as the median and p90 over rounds, tokens/s over all rows,
and the process's peak RSS while each contender ran. The memory-bandwidth floor is the
engine's weight bytes (read once per step) divided by the measured copy bandwidth of one
thread; every per-token time is also given as a multiple of it. Thread count fixed (ONNX
Runtime intra-op threads, torch threads) and reported. ``--device cuda`` runs the ONNX
contenders on the CUDA provider and torch on the GPU (onnxruntime-genai when its CUDA build
is installed). The calm / onnxruntime-genai ratio is also given per round (both ran in the
same round, shuffled) as the median of those paired ratios.

``--prefill-engine`` adds a prefill table: one ``--prefill-tokens`` prompt (batch 1) through
that engine with only the last position projected (``logits_to_keep``, what calm does
now), through the same session projecting every position in chunks (what calm did before,
and still does for engines exported without that input), and through transformers'
forward with ``logits_to_keep=1`` on ``--prefill-model``, alternated per round.
Writes ``results/latency.json`` and ``results/latency.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from _common import git_commit

HERE = Path(__file__).resolve().parent
PROMPT = "Once upon a time, in a small village by the sea,"
logger = logging.getLogger("latency")


# ---------------------------------------------------------------------- memory
class PeakRSS:
    """Samples the process's resident set size every 2 ms while active."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._on = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while True:
            self._on.wait()
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __enter__(self):
        self.peak = self.rss()
        self._on.set()
        return self

    def __exit__(self, *exc):
        self._on.clear()
        self.peak = max(self.peak, self.rss())


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s one thread moves through memory: best of ``repeats`` copies (read + write)."""
    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def weight_bytes(engine: Path) -> int:
    from calm_runtime.formats.engine import EngineManifest

    manifest = EngineManifest.load(engine, verify_hashes=False)
    files = manifest.model.get("files") or [manifest.model["file"]]
    return sum((engine / f).stat().st_size for f in files)


# ---------------------------------------------------------------------- contenders
def ort_loop(backend, prompt_ids, batch, tokens, *, stats=False, calibrate=None):
    """The bare KV-cache loop on a backend: argmax (and optionally confidences) only."""
    from calm_runtime.inference.generation import initial_positions
    from calm_runtime.inference.sampling import step_stats

    ids = np.asarray([prompt_ids] * batch, dtype=np.int64)
    mask = np.ones_like(ids)
    start = time.perf_counter()
    logits, state = backend.run(ids, mask, initial_positions(mask), None, last_only=True)
    positions = initial_positions(mask)[:, -1:]
    prefill = None
    for step in range(tokens):
        z = logits[:, -1]
        if calibrate is not None:
            z = calibrate(z)
        if stats:
            s = step_stats(z)
            chosen = np.argmax(z, axis=-1)
            s.probability(np.arange(batch), chosen)
        else:
            chosen = np.argmax(z, axis=-1)
        if step == 0:
            prefill = time.perf_counter() - start
            start = time.perf_counter()
        if step == tokens - 1:
            break
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        positions = positions + 1
        logits, state = backend.run(chosen[:, None].astype(np.int64), mask, positions, state,
                                    last_only=True)
    return prefill, (time.perf_counter() - start) / (tokens - 1)


def calm_run(lm, prompt_ids, batch, tokens):
    run = lm.generation_run([prompt_ids] * batch, tokens)
    for _ in run:
        pass
    made = min(len(g.tokens) for g in run.results)
    if made < tokens:  # an end-of-sequence token: per-step times would cover a shorter cache
        raise RuntimeError(f"a row stopped after {made} of {tokens} tokens (end of sequence); "
                           "use fewer --tokens")
    t = run.results[0].timing
    return t.prefill_s, t.per_token_s


def transformers_run(model, tokenizer, device, batch, tokens):
    import torch

    enc = tokenizer([PROMPT] * batch, return_tensors="pt").to(device)
    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        model.generate(**enc, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        _sync(device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        _sync(device)
        total = time.perf_counter() - start
    return prefill, (total - prefill) / (tokens - 1)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def genai_folder(engine: Path, threads: int) -> Path:
    """The engine folder as onnxruntime-genai sees it, with ``threads`` intra-op threads.

    genai reads its thread count from ``genai_config.json`` (ONNX Runtime's default, one
    per core, when absent); a temporary folder of links to the engine's files with an edited
    copy of that file holds the comparison at the same thread count as calm's.
    """
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="calm-genai-"))
    for item in engine.iterdir():
        if item.name != "genai_config.json":
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((engine / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    return folder


def genai_runner(engine: Path, device: str, threads: int):
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None, "onnxruntime-genai is not installed (pip install 'calm-llm[genai]')"
    try:
        config = og.Config(str(genai_folder(engine, threads)))
        if device == "cuda":
            config.clear_providers()
            config.append_provider("cuda")
        model = og.Model(config)
    except Exception as exc:  # noqa: BLE001 - reported in the results, not fatal
        return None, f"onnxruntime-genai cannot load the engine: {exc}"

    def run(prompt_ids, batch, tokens):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt_ids) + tokens, do_sample=False,
                                  batch_size=batch)
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.asarray([prompt_ids] * batch, dtype=np.int32))
        generator.generate_next_token()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        steps = 0
        while not generator.is_done() and steps < tokens - 1:
            generator.generate_next_token()
            steps += 1
        if steps < tokens - 1:
            raise RuntimeError(f"onnxruntime-genai stopped after {steps + 1} tokens")
        return prefill, (time.perf_counter() - start) / steps

    return run, None


# ---------------------------------------------------------------------- the run
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="fused engine (calm-export)")
    parser.add_argument("--identity-engine", type=Path,
                        help="the same model exported without an adapter (uncalibrated)")
    parser.add_argument("--int8-engine", type=Path, help="the engine exported with --quantize int8")
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="the engines' source model (transformers and calm's torch backend)")
    parser.add_argument("--adapter", type=Path,
                        help="the adapter the engine was exported with (torch backend, numpy "
                        "calibration)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--skip", nargs="*", default=[], help="contenders to leave out")
    parser.add_argument("--prefill-engine", type=Path,
                        help="engine for the long-prompt prefill table (e.g. Gemma-3-270M's)")
    parser.add_argument("--prefill-model", help="that engine's source model (transformers)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = "python benchmarks/latency.py " + " ".join(
        argv if argv is not None else sys.argv[1:])

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from calm_runtime import CalibratedLM
    from calm_runtime.calibration import apply_calibration
    from calm_runtime.data.models import resolve_model
    from calm_runtime.formats.artifact import CalibrationAdapter

    torch.set_num_threads(args.threads)
    rss = PeakRSS()
    providers = ["CUDAExecutionProvider"] if args.device == "cuda" else None
    loaded, runners, notes = {}, {}, {}

    def load(name, fn):
        if name in args.skip:
            return None
        before = rss.rss()
        value = fn()
        loaded[name] = {"rss_added_mb": (rss.rss() - before) / 2**20}
        return value

    folder = resolve_model(args.model, install=True)  # a command line: it may install
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.padding_side = "left"
    model = load("transformers", lambda: AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32).to(args.device).eval())
    lm = load("calm-onnxruntime", lambda: CalibratedLM.load(
        args.engine, providers=providers, threads=args.threads))
    prompt_ids = lm.tokenizer.encode(PROMPT)
    if model is not None:
        runners["transformers"] = lambda b: transformers_run(model, tokenizer, args.device, b,
                                                             args.tokens)
    runners["calm-onnxruntime"] = lambda b: calm_run(lm, prompt_ids, b, args.tokens)
    if "ort-loop" not in args.skip:
        runners["ort-loop"] = lambda b: ort_loop(lm.backend, prompt_ids, b, args.tokens)
    if args.adapter:
        torch_lm = load("calm-torch", lambda: CalibratedLM.load(
            args.engine, backend="torch", model=str(folder), adapter=str(args.adapter),
            device=args.device, threads=args.threads))
        if torch_lm is not None:
            runners["calm-torch"] = lambda b: calm_run(torch_lm, prompt_ids, b, args.tokens)
    else:
        notes["calm-torch"] = "needs --adapter"
    def add_calm(name: str, engine: Path):
        """A CalibratedLM contender on another engine; returns it (None when skipped)."""
        other = load(name, lambda: CalibratedLM.load(engine, providers=providers,
                                                     threads=args.threads))
        if other is not None:
            runners[name] = lambda b: calm_run(other, prompt_ids, b, args.tokens)
        return other

    plain = None
    if args.identity_engine:
        plain = add_calm("calm-onnxruntime-uncalibrated", args.identity_engine)
    else:
        notes["calm-onnxruntime-uncalibrated"] = "needs --identity-engine"
    if plain is not None and args.adapter:
        adapter = CalibrationAdapter.from_pretrained(args.adapter)

        def calibrate(z):
            return apply_calibration(z, tau=adapter.tau, shift=adapter.shift,
                                     temperature=adapter.temperature)

        runners["ort-loop-unfused-numpy"] = lambda b: ort_loop(
            plain.backend, prompt_ids, b, args.tokens, stats=True, calibrate=calibrate)
        runners["ort-loop-fused"] = lambda b: ort_loop(lm.backend, prompt_ids, b, args.tokens,
                                                       stats=True)
    if args.int8_engine:
        add_calm("calm-onnxruntime-int8", args.int8_engine)
    if "onnxruntime-genai" not in args.skip:
        genai, why = load("onnxruntime-genai", lambda: genai_runner(args.engine, args.device,
                                                                     args.threads))
        if genai is not None:
            runners["onnxruntime-genai"] = lambda b: genai(prompt_ids, b, args.tokens)
        else:
            notes["onnxruntime-genai"] = why

    bandwidth = copy_bandwidth() if args.device == "cpu" else None
    weights = {"fp32": weight_bytes(args.engine)}
    if args.int8_engine:
        weights["int8"] = weight_bytes(args.int8_engine)

    samples = {(n, b): {"prefill": [], "per_token": [], "peak_rss": 0}
               for n in runners for b in args.batches}
    for name, run in runners.items():  # warm-up: first-call allocations and lazy inits
        for batch in args.batches:
            try:
                run(batch)
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported
                notes[f"{name}@{batch}"] = f"failed: {exc}"
    failed = {k for k in notes if "@" in k}
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        for batch in args.batches:
            names = list(runners)
            order.shuffle(names)  # no contender always runs right after the same other one
            for name in names:
                run = runners[name]
                if f"{name}@{batch}" in failed:
                    continue
                with rss:
                    prefill, per_token = run(batch)
                cell = samples[(name, batch)]
                cell["prefill"].append(prefill)
                cell["per_token"].append(per_token)
                cell["peak_rss"] = max(cell["peak_rss"], rss.peak)
        logger.info("round %d/%d done", r + 1, args.rounds)

    results = []
    for (name, batch), cell in samples.items():
        if not cell["per_token"]:
            continue
        ordered = sorted(cell["per_token"])
        median = statistics.median(ordered)
        floor_bytes = weights["int8" if name.endswith("int8") else "fp32"]
        floor_s = floor_bytes / bandwidth if bandwidth else None
        results.append({
            "contender": name, "batch": batch,
            "prefill_ms": 1e3 * statistics.median(cell["prefill"]),
            "per_token_ms_median": 1e3 * median,
            "per_token_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "tokens_per_s": batch / median,
            "peak_rss_mb": cell["peak_rss"] / 2**20,
            "rss_added_at_load_mb": loaded.get(name, {}).get("rss_added_mb"),
            "floor_ms": None if floor_s is None else 1e3 * floor_s,
            "x_floor": None if floor_s is None else median / floor_s})

    def per_token(name, batch):
        row = next((r for r in results if r["contender"] == name and r["batch"] == batch), None)
        return None if row is None else row["per_token_ms_median"]

    ratios = {}
    for batch in args.batches:
        calm = per_token("calm-onnxruntime", batch)
        pairs = {"calm_over_ort_loop (runtime work incl. confidences)": "ort-loop",
                 "fused_over_uncalibrated (cost of fusing)": "calm-onnxruntime-uncalibrated",
                 "calm_over_genai": "onnxruntime-genai",
                 "calm_over_transformers": "transformers", "calm_over_calm_torch": "calm-torch",
                 "calm_over_int8": "calm-onnxruntime-int8"}
        ratios[batch] = {k: calm / per_token(v, batch) for k, v in pairs.items()
                         if calm and per_token(v, batch)}
        unfused, fused = (per_token("ort-loop-unfused-numpy", batch),
                          per_token("ort-loop-fused", batch))
        if unfused and fused:
            ratios[batch]["unfused_numpy_over_fused"] = unfused / fused
    for batch in args.batches:
        calm, genai = (samples.get(("calm-onnxruntime", batch)),
                       samples.get(("onnxruntime-genai", batch)))
        if calm and genai and calm["per_token"] and len(calm["per_token"]) == len(
                genai["per_token"]):
            ratios[batch]["calm_over_genai_paired (median of per-round ratios)"] = \
                statistics.median(c / g for c, g in zip(calm["per_token"], genai["per_token"],
                                                        strict=True))
    confidence_ms = _confidence_cost(lm, prompt_ids, args.batches)
    prefill = None
    if args.prefill_engine:
        del runners, model, lm
        prefill = prefill_table(args.prefill_engine, args.prefill_model, args.prefill_tokens,
                                args.threads, args.rounds)
    payload = {"command": command.strip(), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "device": args.device, "threads": args.threads, "tokens": args.tokens,
               "rounds": args.rounds, "engine": str(args.engine),
               "weight_bytes": weights,
               "copy_bandwidth_gb_s": None if bandwidth is None else bandwidth / 1e9,
               "confidence_ms_per_step": confidence_ms, "results": results,
               "ratios": {str(k): v for k, v in ratios.items()}, "notes": notes,
               "prefill": prefill}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "latency" if args.device == "cpu" else f"latency-{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
    text = format_markdown(payload)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0


def prefill_table(engine: Path, model_spec: str | None, tokens: int, threads: int,
                  rounds: int) -> dict:
    """Milliseconds to prefill one ``tokens``-long prompt: last position only vs every
    position (chunked) on the same session, and transformers with ``logits_to_keep=1``."""
    from calm_runtime import CalibratedLM
    from calm_runtime.inference.generation import initial_positions

    lm = CalibratedLM.load(engine, threads=threads)
    text = " ".join([PROMPT] * (4 * tokens // max(1, len(lm.tokenizer.encode(PROMPT))) + 4))
    ids = np.asarray([lm.tokenizer.encode(text)[:tokens]], dtype=np.int64)
    if ids.shape[1] < tokens:
        raise RuntimeError(f"the prompt has only {ids.shape[1]} tokens")
    mask = np.ones_like(ids)
    positions = initial_positions(mask)
    backend = lm.backend
    keeps = getattr(backend, "keeps_logits", False)

    def calm(last: bool):
        def run():
            backend.keeps_logits = keeps and last
            try:
                start = time.perf_counter()
                backend.run(ids, mask, positions, None, last_only=True)
                return time.perf_counter() - start
            finally:
                backend.keeps_logits = keeps
        return run

    runners = {"calm-last-position": calm(True), "calm-every-position": calm(False)}
    if model_spec:
        import torch
        from transformers import AutoModelForCausalLM

        from calm_runtime.data.models import resolve_model

        model = AutoModelForCausalLM.from_pretrained(
            str(resolve_model(model_spec, install=True)), dtype=torch.float32).eval()

        def transformers_forward():
            with torch.inference_mode():
                start = time.perf_counter()
                model(input_ids=torch.as_tensor(ids), logits_to_keep=1)
                return time.perf_counter() - start
        runners["transformers-logits_to_keep=1"] = transformers_forward
    for run in runners.values():
        run()  # warm-up
    seconds = {name: [] for name in runners}
    order = np.random.default_rng(1)
    for _ in range(rounds):
        names = list(runners)
        order.shuffle(names)
        for name in names:
            seconds[name].append(runners[name]())
    ms = {name: 1e3 * statistics.median(s) for name, s in seconds.items()}
    return {"engine": str(engine), "model": model_spec, "tokens": tokens,
            "logits_to_keep_in_graph": keeps, "vocab_size": lm.manifest.vocab_size,
            "ms_median": ms, "ms_all": {k: [1e3 * x for x in v] for k, v in seconds.items()},
            "every_over_last": ms["calm-every-position"] / ms["calm-last-position"]}


def _confidence_cost(lm, prompt_ids, batches) -> dict:
    """Milliseconds of ``step_stats`` (the confidences) on the engine's real logits, per step."""
    from calm_runtime.inference.generation import initial_positions
    from calm_runtime.inference.sampling import step_stats

    out = {}
    for batch in batches:
        ids = np.asarray([prompt_ids] * batch, dtype=np.int64)
        mask = np.ones_like(ids)
        logits, _ = lm.backend.run(ids, mask, initial_positions(mask), None, last_only=True)
        z = np.ascontiguousarray(logits[:, -1])
        start = time.perf_counter()
        for _ in range(100):
            step_stats(z)
        out[str(batch)] = 1e3 * (time.perf_counter() - start) / 100
    return out


def format_markdown(p: dict) -> str:
    bw = p["copy_bandwidth_gb_s"]
    lines = [f"`{p['command']}` at {p['commit']} ({p['date']}); device {p['device']}, "
             f"{p['threads']} thread(s), {p['tokens']} tokens, {p['rounds']} rounds; "
             f"weights {p['weight_bytes']['fp32'] / 1e6:.0f} MB fp32"
             + (f", {p['weight_bytes']['int8'] / 1e6:.0f} MB int8" if "int8" in p["weight_bytes"]
                else "")
             + ("" if bw is None else f"; one-thread copy bandwidth {bw:.1f} GB/s"), "",
             "| contender | batch | prefill ms | ms/step median | p90 of rounds | tokens/s | "
             "x floor | RSS added at load MB | process peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(p["results"], key=lambda r: (r["batch"], r["per_token_ms_median"])):
        floor = "-" if r["x_floor"] is None else f"{r['x_floor']:.2f} ({r['floor_ms']:.1f} ms)"
        added = r["rss_added_at_load_mb"]
        lines.append(f"| {r['contender']} | {r['batch']} | {r['prefill_ms']:.1f} | "
                     f"{r['per_token_ms_median']:.2f} | {r['per_token_ms_p90']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {floor} | "
                     f"{'-' if added is None else f'{added:.0f}'} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "ratios of per-step medians (calm-onnxruntime over X; < 1 means calm is faster):",
              ""]
    for batch, ratios in p["ratios"].items():
        for k, v in ratios.items():
            lines.append(f"* batch {batch}: {k} = {v:.3f}")
    lines += ["", "confidences alone (step_stats on real logits): " + ", ".join(
        f"batch {b}: {ms:.3f} ms/step" for b, ms in p["confidence_ms_per_step"].items())]
    pre = p.get("prefill")
    if pre:
        lines += ["", f"prefill of one {pre['tokens']}-token prompt on `{pre['engine']}` "
                  f"(vocabulary {pre['vocab_size']:,}; median of {p['rounds']} rounds, "
                  "alternated):", "", "| path | ms |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in sorted(pre["ms_median"].items(),
                                                           key=lambda kv: kv[1])]
        lines += ["", f"every position / last position = {pre['every_over_last']:.2f}"]
    if p["notes"]:
        lines += ["", "notes: " + "; ".join(f"{k}: {v}" for k, v in p["notes"].items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
