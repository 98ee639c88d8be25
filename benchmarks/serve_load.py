"""Load test of ``calm serve``: concurrent openai clients, micro-batching on vs off.

    python benchmarks/serve_load.py --engine ENGINE_DIR [--clients 16] [--requests 20]

One process: the server (uvicorn on a background thread, loopback, a free port) and
``--clients`` threads, each an official ``openai`` client sending ``--requests`` greedy
completions of ``--max-tokens`` tokens over a fixed set of ARC-Easy questions. It runs
twice on the same engine instance, micro-batching on (``--max-batch-size``, default 8,
5 ms window) and off (batch size 1), and checks every answer against a serial, direct
:class:`CalibratedLM` call on the same prompt (text exact, token confidences within 1e-4).

Reports, per mode: errors, mismatches, p50/p90/p99 request latency, requests/s and
generated tokens/s, and the batch sizes the server formed (from its ``/metrics``).
Writes ``OUT/serve_load.json`` and ``.md`` naming the command and commit. Bounded: it
sends ``clients x requests`` requests per mode and stops.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from _common import git_commit

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("serve_load")


def _prompts(n: int) -> list[str]:
    from calm_runtime.data.prompts import cloze_context
    from calm_runtime.data.sets import load_dataset

    return [cloze_context(r.question) for r in load_dataset("arc-easy:test", install=True)[:n]]


def _percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _batch_sizes(metrics_text: str) -> dict:
    count = total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("calm_batch_size_count"):
            count = float(line.split()[-1])
        elif line.startswith("calm_batch_size_sum"):
            total = float(line.split()[-1])
    return {"batches": int(count), "mean_rows_per_batch": total / count if count else None}


def run_mode(lm, args, prompts, refs, *, batch_size: int, window_ms: float) -> dict:
    import httpx
    import openai

    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    config = ServeConfig(engine=str(args.engine), model_name="engine", max_batch_size=batch_size,
                         batch_window_ms=window_ms, max_queue=max(64, args.clients * 2),
                         max_tokens_limit=max(args.max_tokens, 16))
    latencies, errors, mismatches, tokens = [], [], [], 0

    def client(c: int):
        cli = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        out = []
        for i in range(args.requests):
            prompt = prompts[(c * args.requests + i) % len(prompts)]
            started = time.perf_counter()
            try:
                r = cli.completions.create(model="engine", prompt=prompt,
                                           max_tokens=args.max_tokens, temperature=0)
            except openai.APIError as exc:
                out.append((prompt, None, repr(exc), time.perf_counter() - started))
            else:
                out.append((prompt, r.choices[0], None, time.perf_counter() - started))
        return out

    with serve_in_background(create_app(config, lm)) as (url, _):
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            rows = [x for part in pool.map(client, range(args.clients)) for x in part]
        wall = time.perf_counter() - started
        batches = _batch_sizes(httpx.get(url + "/metrics").text)
    for prompt, choice, error, latency in rows:
        latencies.append(latency)
        if error is not None:
            errors.append(error)
            continue
        ref = refs[prompt]
        confidences = choice.model_extra["calm"]["token_confidences"]
        tokens += len(confidences)
        if choice.text != ref.text or len(confidences) != len(ref.tokens) or not np.allclose(
                confidences, [t.confidence for t in ref.tokens], rtol=0, atol=1e-4):
            mismatches.append(prompt[:60])
    return {"max_batch_size": batch_size, "batch_window_ms": window_ms,
            "requests": len(rows), "errors": len(errors), "error_examples": errors[:3],
            "mismatches": len(mismatches), "wall_s": wall,
            "latency_s_p50": _percentile(latencies, 50),
            "latency_s_p90": _percentile(latencies, 90),
            "latency_s_p99": _percentile(latencies, 99),
            "latency_s_mean": statistics.fmean(latencies),
            "requests_per_s": len(rows) / wall, "tokens_per_s": tokens / wall, **batches}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True, type=Path, help="engine directory")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=40, help="distinct ARC-Easy prompts")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for chatty in ("httpx", "openai"):  # one line per request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)

    from calm_runtime import CalibratedLM

    command = "python benchmarks/serve_load.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    lm = CalibratedLM.load(args.engine, threads=args.threads)
    prompts = _prompts(args.prompts)
    started = time.perf_counter()
    refs = {p: lm.generate(p, max_new_tokens=args.max_tokens) for p in prompts}
    serial_s = time.perf_counter() - started
    logger.info("serial reference: %d prompts in %.1f s", len(prompts), serial_s)
    modes = {}
    for name, size, window in (("batching on", args.max_batch_size, 5.0),
                               ("batching off", 1, 0.0)):
        logger.info("%s: %d clients x %d requests", name, args.clients, args.requests)
        modes[name] = run_mode(lm, args, prompts, refs, batch_size=size, window_ms=window)
        logger.info("%s: %s", name, {k: v for k, v in modes[name].items()
                                     if k != "error_examples"})
    payload = {"command": command.strip(), "commit": git_commit(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "engine": str(args.engine), "backend": lm.backend.description,
               "clients": args.clients, "requests_per_client": args.requests,
               "max_tokens": args.max_tokens, "serial_reference_s": serial_s, "modes": modes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_load.json").write_text(json.dumps(payload, indent=1) + "\n")
    on, off = modes["batching on"], modes["batching off"]
    lines = [f"`{payload['command']}` at {payload['commit']} ({payload['date']}), "
             f"{args.clients} clients x {args.requests} requests, {args.max_tokens} tokens, "
             f"{lm.backend.description}", "",
             "| micro-batching | errors | mismatches vs serial | p50 s | p99 s | requests/s | "
             "tokens/s | mean rows/batch |", "|---|---|---|---|---|---|---|---|"]
    for name, m in modes.items():
        rows = m["mean_rows_per_batch"]
        lines.append(f"| {name} | {m['errors']} | {m['mismatches']} | {m['latency_s_p50']:.2f} | "
                     f"{m['latency_s_p99']:.2f} | {m['requests_per_s']:.2f} | "
                     f"{m['tokens_per_s']:.1f} | {'-' if rows is None else f'{rows:.2f}'} |")
    lines += ["", f"throughput with batching: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x "
              "the unbatched server"]
    (args.out / "serve_load.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(m["errors"] or m["mismatches"] for m in modes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
