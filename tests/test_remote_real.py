"""Calibrating a served model: DACA through two real ``calm serve`` processes on loopback
(an uncalibrated SmolLM2-135M-Instruct engine as the model, an uncalibrated tiny engine as
the reference) equals DACA on the same models loaded locally, in cloze and letter mode."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
N_QUESTIONS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export(model_dir, out):
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    export_engine(model_dir, out, config=ExportConfig(greedy_steps=2, progress=False,
                                                      exporter="torchscript"))
    return out


def _tiny_reference(folder):
    """A random 2-layer Llama with the tests' tokenizer and a context long enough for ARC."""
    import torch
    from conftest import tiny_llama_config, tiny_tokenizer
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tied=False)
    config.max_position_embeddings = 2048
    torch.manual_seed(5)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Two `calm serve` processes: the SmolLM2 engine and the tiny reference engine."""
    from calm_runtime.data.models import install_model

    root = tmp_path_factory.mktemp("remote")
    smol = install_model(MODEL)
    tiny = _tiny_reference(root / "tiny")
    engines = {"model": _export(smol, root / "smol-engine"),
               "reference": _export(tiny, root / "tiny-engine")}
    procs, urls = [], {}
    try:
        for role, engine in engines.items():
            port = _free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", str(engine),
                 "--port", str(port), "--threads", "1", "--model-name", role],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            urls[role] = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 120
        for role, url in urls.items():
            while True:
                try:
                    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2):
                        break
                except OSError:
                    assert time.monotonic() < deadline, f"calm serve for {role} did not start"
                    assert all(p.poll() is None for p in procs), procs[0].stderr.read()
                    time.sleep(0.25)
        yield urls, smol, tiny
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    from calm_runtime.data.sets import install_dataset

    path = tmp_path_factory.mktemp("data") / "arc40.jsonl"
    lines = install_dataset("arc-easy").read_text().splitlines()[:N_QUESTIONS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("mode", ["cloze", "letter"])
def test_daca_through_served_models_equals_the_local_path(served, questions, tmp_path, mode,
                                                          monkeypatch):
    from calm_runtime import CalibrationAdapter
    from calm_runtime.errors import FitError
    from calm_training.fit import compare_methods, fit_adapter
    from calm_training.posthoc.fit_config import FitConfig

    monkeypatch.setenv("CALM_CACHE", os.environ.get("CALM_CACHE", str(tmp_path / "cache")))
    urls, smol, tiny = served
    common = {"data": str(questions), "mode": mode, "chat": False, "bootstrap": 0}
    local = FitConfig(model=str(smol), reference=str(tiny), **common)
    remote = FitConfig(model=urls["model"], reference=urls["reference"], concurrency=4,
                       **common)
    # DACA and labeled TS (letters outside the 20 alternatives a server returns are scored by
    # echo, so letter mode is exact too; where a fit has no finite optimum, both paths must
    # refuse alike)
    for method in ("daca", "ts"):
        outcomes, token_fits = [], []
        for name, config in (("local", local), ("remote", remote)):
            try:
                report = fit_adapter(config, method, tmp_path / f"{name}-{method}",
                                     overwrite=True, progress=False)[1]
                outcomes.append(report["fit"])
                token_fits.append(report.get("token_fit"))
            except FitError as exc:
                outcomes.append(str(exc))
        if isinstance(outcomes[0], str):
            assert outcomes[1] == outcomes[0], outcomes
            continue
        if mode == "cloze" and token_fits[0] and token_fits[0]["fitted"]:
            # locally the head also gets a token-level temperature (labels, or a reference
            # with the same tokenizer) and the option temperature is fitted on top of it; a
            # served model has no head to carry one: its fit is option-level only
            assert token_fits[1]["fitted"] is False and "served" in token_fits[1]["reason"]
            continue
        t_local, t_remote = outcomes[0]["temperature"], outcomes[1]["temperature"]
        assert abs(t_remote - t_local) / t_local < 1e-3, (method, t_local, t_remote)
        assert outcomes[1]["n_used"] == outcomes[0]["n_used"]
    if mode == "cloze":
        assert (tmp_path / "remote-daca").is_dir()  # the served model's DACA adapter

    adapter = CalibrationAdapter.from_pretrained(tmp_path / "remote-ts")
    assert adapter.base_model.served == {"endpoint": urls["model"], "served_model": "model"}
    assert adapter.base_model.vocab_size == 0 and adapter.tau.size == 0
    assert "key" not in json.dumps(adapter.provenance).lower()

    compared = ("vanilla", "naive", "daca", "ts")
    tables = [compare_methods(config, compared, progress=False) for config in (local, remote)]
    for name in compared:
        a, b = tables[0]["methods"][name], tables[1]["methods"][name]
        if "error" in a:
            assert b == a, name
            continue
        assert a["accuracy"] == b["accuracy"], name
        for key in ("ece", "nll", "brier"):
            np.testing.assert_allclose(b[key], a[key], atol=1e-3, err_msg=f"{name} {key}")
