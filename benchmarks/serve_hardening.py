"""`calm serve` against the ways a client can hold it: long echo requests (memory, and
memory after them), requests past their deadline in every scoring pass (echo, constrained
choices, P(True)), with and without other processes on the server's cores, a flood of
half-open connections, idle and trickling connections.

    python benchmarks/serve_hardening.py                     # result files below
    python benchmarks/serve_hardening.py --default-timeout   # also a request past 120 s
    python benchmarks/serve_hardening.py --render            # the .md from the .json

Engine: SmolLM2-135M-Instruct exported by calm-export with no adapter (the default graph),
served by `calm serve` as a separate process; RSS is the server process's (VmRSS; the peak
is VmHWM, reset before each request through /proc/PID/clear_refs). "Load" runs two busy
processes on the machine's cores while the request runs. Writes
benchmarks/results/serve_hardening.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from _common import command_line, git_commit, machine

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "serve_hardening.json"
MODEL = "smollm2-135m-instruct"
WORDS = "The quick brown fox jumps over the lazy dog. "  # 11 tokens with BOS counted apart


def _status(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def _post(port: int, body: dict, timeout: float = 900) -> tuple[int, dict | None, float]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            payload = json.loads(answer.read())
            return answer.status, payload, time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), time.monotonic() - start


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


class Server:
    def __init__(self, engine: Path, port: int, *options: str) -> None:
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "calm_runtime.cli.main", "serve", str(engine), "--port",
             str(port), "--model-name", "m", *options], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(Path(self.log.name).read_text()[-2000:])

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measured(server: Server, body: dict, *, load: bool = False, settle: float = 2.0) -> dict:
    before = _status(server.pid, "VmRSS")
    _reset_peak(server.pid)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,)) for _ in range(2 if load
                                                                                else 0)]
    for b in burners:
        b.start()
    try:
        status, payload, took = _post(server.port, body)
    finally:
        stop.set()
        for b in burners:
            b.join()
    peak = _status(server.pid, "VmHWM")
    # the work a stopped request left running ends at its next step: RSS is read until it
    # is back within 50 MB of before, or for `settle` seconds at most
    ended = time.monotonic()
    after = _status(server.pid, "VmRSS")
    while after - before > 50 and time.monotonic() - ended < settle:
        time.sleep(0.25)
        after = _status(server.pid, "VmRSS")
    return {"status": status, "seconds": round(took, 2), "rss_before_mb": round(before),
            "peak_growth_mb": round(peak - before), "rss_after_mb": round(after),
            "after_minus_before_mb": round(after - before),
            "settled_after_s": round(time.monotonic() - ended, 1), "load": load,
            "error": (payload or {}).get("error", {}).get("code") if status != 200 else None}


def echo_memory(engine: Path) -> list[dict]:
    server = Server(engine, _free_port())
    rows = []
    try:
        for tokens in (960, 1920, 3840, 6400):
            row = _measured(server, {"model": "m", "prompt": WORDS * (tokens // 10),
                                     "echo": True, "max_tokens": 0, "logprobs": 20},
                            settle=10.0)
            rows.append({"case": f"echo, ~{tokens} tokens, logprobs 20", **row})
            print(rows[-1], flush=True)
    finally:
        server.stop()
    return rows


def deadlines(engine: Path, timeout: float | None) -> list[dict]:
    options = () if timeout is None else ("--request-timeout", str(timeout))
    server = Server(engine, _free_port(), *options)
    long_prompt = WORDS * 190  # ~1.9k tokens
    cases = [
        ("echo, 60 prompts x ~1.9k tokens, logprobs 1",
         {"model": "m", "prompt": [long_prompt] * 60, "echo": True, "max_tokens": 0,
          "logprobs": 1}),
        ("constrained choice, 16 prompts x ~1.9k tokens, 4 choices",
         {"model": "m", "prompt": [long_prompt] * 16,
          "guided_choice": [" yes it is", " no it is not", " perhaps", " never"]}),
        ("P(True), 16 prompts x ~1.9k tokens",
         {"model": "m", "prompt": [long_prompt] * 16, "max_tokens": 4, "temperature": 0,
          "calm": {"p_true": True}}),
    ]
    rows = []
    try:
        for load in ((False, True) if timeout is not None else (True,)):
            for name, body in cases:
                row = _measured(server, body, load=load, settle=60.0)
                row["past_deadline_s"] = round(row["seconds"] - (timeout or 120.0), 2)
                rows.append({"case": name, "timeout_s": timeout or 120.0, **row})
                print(rows[-1], flush=True)
    finally:
        server.stop()
    return rows


def connections(engine: Path) -> dict:
    server = Server(engine, _free_port())
    port = server.port
    try:
        flood = []
        for _ in range(1200):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            flood.append(sock)
        time.sleep(0.5)
        fds = len(os.listdir(f"/proc/{server.pid}/fd"))
        start = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10):
            health = time.monotonic() - start
        status, _, normal = _post(port, {"model": "m", "prompt": "Hello", "max_tokens": 4,
                                         "temperature": 0})
        for sock in flood:
            sock.close()
        idle = socket.create_connection(("127.0.0.1", port), timeout=60)
        start = time.monotonic()
        idle_closed = None
        if idle.recv(1) == b"":
            idle_closed = time.monotonic() - start
        trickle = socket.create_connection(("127.0.0.1", port), timeout=60)
        sent = [0]

        def drip() -> None:  # a byte a second until the server closes the connection
            try:
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n" * 10:
                    trickle.sendall(bytes([byte]))
                    sent[0] += 1
                    time.sleep(1.0)
            except OSError:
                pass

        start = time.monotonic()
        dripping = threading.Thread(target=drip, daemon=True)
        dripping.start()
        answer = b""
        while chunk := trickle.recv(4096):
            answer += chunk
        trickle_closed = time.monotonic() - start
        trickle_status = answer.split(b" ")[1].decode() if answer else None
        return {"half_open_connections": 1200, "server_fds_during_flood": fds,
                "health_seconds": round(health, 3), "completion_status": status,
                "completion_seconds": round(normal, 3),
                "idle_closed_after_s": None if idle_closed is None else round(idle_closed, 2),
                "trickle_closed_after_s": round(trickle_closed, 2),
                "trickle_bytes_sent": sent[0], "trickle_status": trickle_status}
    finally:
        server.stop()


def render(result: dict) -> str:
    lines = [f"# calm serve under hostile clients\n\n`{result['command']}` at {result['commit']}"
             f" on {result['machine']['cpu']} ({result['machine']['cores']} cores).\n",
             "## Echo memory (SmolLM2-135M, server RSS)\n",
             "| request | status | s | RSS before | peak growth | RSS after | after − before |",
             "|---|---|---|---|---|---|---|"]
    for r in result["echo_memory"]:
        lines.append(f"| {r['case']} | {r['status']} | {r['seconds']} | {r['rss_before_mb']} "
                     f"| +{r['peak_growth_mb']} | {r['rss_after_mb']} | "
                     f"{r['after_minus_before_mb']:+d} |")
    lines += ["", "RSS after: read until back within 50 MB of before, for 10 s at most.", "",
              "## Deadlines\n",
              "| request | timeout | other load | status | s | past deadline "
              "| RSS after − before | settled after |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result["deadlines"]:
        load = "2 busy processes" if r["load"] else "-"
        lines.append(f"| {r['case']} | {r['timeout_s']:g} s | {load} "
                     f"| {r['status']} | {r['seconds']} | {r['past_deadline_s']:+.2f} s | "
                     f"{r['after_minus_before_mb']:+d} MB | {r['settled_after_s']} s |")
    c = result["connections"]
    lines += ["", "RSS after: read until back within 50 MB of before (the work a stopped "
              "request leaves ends at its next step), for 60 s at most; \"settled after\" is "
              "when, counted from the answer.", "", "## Connections\n",
              f"{c['half_open_connections']} half-open connections from one address: the "
              f"server held {c['server_fds_during_flood']} file descriptors; `/health` answered "
              f"in {c['health_seconds']} s and a 4-token completion ({c['completion_status']}) "
              f"in {c['completion_seconds']} s. An idle connection was closed after "
              f"{c['idle_closed_after_s']} s, one trickling a byte a second after "
              f"{c['trickle_closed_after_s']} s ({c['trickle_bytes_sent']} bytes sent, "
              f"answered {c['trickle_status']}; "
              f"--header-timeout {result['header_timeout_s']:g} s).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-timeout", action="store_true",
                        help="also run the scoring requests with the default 120 s timeout")
    parser.add_argument("--render", action="store_true", help="only rewrite the .md")
    args = parser.parse_args(argv)
    if args.render:
        OUT.with_suffix(".md").write_text(render(json.loads(OUT.read_text())))
        return 0
    from calm_export import ExportConfig, export_engine
    from calm_runtime.data.models import install_model
    from calm_runtime.server.config import ServeConfig

    with tempfile.TemporaryDirectory() as tmp:
        engine = Path(tmp) / "engine"
        export_engine(install_model(MODEL), engine, config=ExportConfig(progress=False))
        result = {"command": command_line("serve_hardening.py", argv or sys.argv[1:]),
                  "commit": git_commit(), "machine": machine(),
                  "header_timeout_s": ServeConfig(engine="x").header_timeout_s}
        result["echo_memory"] = echo_memory(engine)
        result["deadlines"] = deadlines(engine, 8.0)
        if args.default_timeout:
            result["deadlines"] += deadlines(engine, None)
        result["connections"] = connections(engine)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    OUT.with_suffix(".md").write_text(render(result))
    print(OUT.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
