"""docs/tutorial.md run as written, on the packaged pair (SmolLM2-135M-Instruct against
Gemma-3-270M, ARC-Easy), then the client snippets of docs/guide.md and docs/server.md against
the engine it exported, served.

Every bash block of the tutorial runs in order in one folder, with the variables of step 1
set to the packaged pair the tutorial names for machines without a model hub; the JSON
example of step 2 is the file `calm data check` reads; `calm serve` and the `curl` of step 7
run with a free port in place of 8000. Step 8's abstention command runs too (on the whole
set, as written). The snippets of the guide and of server.md run as written against the
engine served under the name they use (`daca`), the port again replaced.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("openai")

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TUTORIAL = (DOCS / "tutorial.md").read_text(encoding="utf-8")


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _packaged_pair() -> str:
    """The tutorial's own words for the packaged pair: ``MODEL=...``, ``BASE=...``."""
    found = re.findall(r"`((?:MODEL|BASE)=[\w.-]+)`", TUTORIAL)
    assert {f.split("=")[0] for f in found} == {"MODEL", "BASE"}, found
    return "\n".join(found)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the environment the commands run in: this interpreter's scripts (calm, calm-export) first
ENV = {**os.environ,
       "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _run(script: str, cwd: Path, timeout: float = 900) -> str:
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env=ENV)
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout + done.stderr


def _serve(argv: list[str], cwd: Path, port: int):
    log = open(cwd / f"serve-{port}.log", "w")  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert process.poll() is None, (cwd / f"serve-{port}.log").read_text()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process, log
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise AssertionError("calm serve did not answer /health within 180 s")


def _stop(process, log) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def sitting(tmp_path_factory):
    """The tutorial's steps 1–6 and 8's abstention, run in one folder; their outputs."""
    here = tmp_path_factory.mktemp("tutorial")
    outputs = {}
    variables = None
    for block in _blocks(TUTORIAL, "bash"):
        if "pip install" in block or "calm serve" in block or "curl " in block:
            continue  # installing is CI's job; serving is the test's below
        if block.lstrip().startswith("MODEL="):  # step 1: the hub pair, or the packaged one
            variables = "\n".join(
                line.split("#", 1)[0].strip() for line in block.splitlines()
                if line.strip() and not line.startswith(("MODEL=", "BASE=")))
            variables = _packaged_pair() + "\n" + variables
            continue
        if "my-questions.jsonl" in block:  # step 2's file: the tutorial's own example line
            example = _blocks(TUTORIAL, "json")[0]
            (here / "my-questions.jsonl").write_text(example)
        assert variables is not None, "step 1 sets the variables before any command"
        outputs[block] = _run(variables + "\n" + block, here)
    abstain = re.search(r"`(calm fit threshold [^`]+)`", TUTORIAL)
    assert abstain, "the tutorial's abstention step"
    command = " ".join(abstain.group(1).split())
    outputs["abstain"] = _run(variables + "\n" + command, here)
    return here, outputs


def _output_of(outputs: dict, needle: str) -> str:
    found = [out for block, out in outputs.items() if needle in block]
    assert len(found) == 1, needle
    return found[0]


def test_the_tutorial_runs_as_written(sitting):
    here, outputs = sitting
    assert (here / "adapters" / "mine" / "calm_adapter.json").is_file()
    assert (here / "engines" / "mine" / "calm_engine.json").is_file()
    assert (here / "adapters" / "mine-abstain" / "calm_adapter.json").is_file()
    assert "1 valid records" in _output_of(outputs, "calm data check")
    compare = _output_of(outputs, "--compare")
    assert "reading (paired bootstrap" in compare  # advice only as the intervals decide
    assert (here / "calm-out" / "reports").is_dir()


def test_the_eval_row_shows_the_temperature_the_adapter_applies(sitting):
    here, outputs = sitting
    from calm_runtime.formats.artifact import CalibrationAdapter

    adapter = CalibrationAdapter.from_pretrained(here / "adapters" / "mine")
    out = _output_of(outputs, "calm eval --model $MODEL --adapter")
    row = next(line for line in out.splitlines() if line.startswith("| daca |"))
    answer_t = adapter.answer_temperature
    assert answer_t is not None and answer_t != 1
    assert row.split("|")[2].strip() == f"{answer_t:.3f}", row


def test_outputs_say_the_head_carries_nothing(sitting):
    """The packaged pair's cloze DACA fit has no token-level part: the export says it folds
    nothing, the manifest's fused is false, generate labels tokens uncalibrated."""
    here, outputs = sitting
    export = _output_of(outputs, "calm-export")
    assert "folds nothing into the LM head" in export
    manifest = json.loads((here / "engines" / "mine" / "calm_engine.json").read_text())
    assert manifest["calibration"]["fused"] is False
    assert manifest["calibration"]["outputs"]["token_logprobs"] is None
    generated = _output_of(outputs, "calm generate")  # step 6: calm score, then generate
    assert "UNCALIBRATED: this engine's head carries no token-level calibration" in generated
    assert "| calibrated engine |" in generated  # the answer temperature: options calibrated


@pytest.fixture(scope="module")
def served(sitting):
    """The engine served twice: as the tutorial serves it (name ``mine``), and as the guide
    and server.md do (``calm serve engines/daca``), each on a free port."""
    here, _ = sitting
    (here / "engines" / "daca").symlink_to("mine")
    servers = {}
    try:
        for name in ("mine", "daca"):
            line = next(line for block in _blocks((DOCS / ("tutorial.md" if name == "mine"
                                                            else "server.md")).read_text(),
                                                  "bash")
                        for line in block.splitlines() if line.startswith("calm serve engines/"))
            port = _free_port()
            argv = shlex.split(line.split("#", 1)[0].replace("8000", str(port)))
            servers[name] = (port, *_serve(argv, here, port))
        yield here, {name: port for name, (port, *_) in servers.items()}
    finally:
        for _, process, log in servers.values():
            _stop(process, log)


def test_the_tutorials_curl_is_answered(served):
    here, ports = served
    curl = next(block for block in _blocks(TUTORIAL, "bash") if "curl " in block)
    out = json.loads(_run(curl.replace("8000", str(ports["mine"])), here))
    calm = out["choices"][0]["calm"]
    assert out["choices"][0]["text"] and len(calm["token_confidences"]) >= 1
    assert out["calm"]["calibration"]["fused"] is False  # the response's engine identity
    assert calm["calibrated"]["token_logprobs"] is None


@pytest.mark.parametrize("page,language", [("guide.md", "text"), ("server.md", "python")])
def test_the_client_snippets_run_against_the_served_engine(served, page, language,
                                                           monkeypatch):
    here, ports = served
    monkeypatch.chdir(here)
    snippets = [b for b in _blocks((DOCS / page).read_text(encoding="utf-8"), language)
                if "import openai" in b or "CalibratedLM" in b]
    assert snippets, page
    for snippet in snippets:
        code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{ports['daca']}")
        namespace = {"__name__": "__docs__"}
        exec(compile(code, f"docs/{page}", "exec"), namespace)  # noqa: S102
    if page == "guide.md":  # the engine's own P(True) is uncalibrated here, and says so
        assert namespace["lm"].calibrated_outputs["p_true"] is None


def test_the_curl_blocks_of_server_md_are_answered(served):
    here, ports = served
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    blocks = [b for b in _blocks(text, "bash") if b.lstrip().startswith("curl ")]
    assert len(blocks) >= 2
    for block in blocks:
        out = json.loads(_run(block.replace("8000", str(ports["daca"])), here))
        assert "error" not in out, out
        calm = out["choices"][0]["calm"]
        if "guided_choice" in block:
            assert calm["calibrated"]["option_probabilities"].startswith("daca: cloze")
            assert sum(calm["option_probabilities"]) == pytest.approx(1, abs=1e-6)
