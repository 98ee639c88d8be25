"""A ``calm train --resume`` checkpoint mutated field by field (wrong type, wrong shape,
out-of-range number, missing key, extra key, another file format, a FIFO): exit 1, exactly one
line on stderr naming what does not match and how to go on, no traceback, no adapter written,
the checkpoint left as it was. The checkpoint is checked as a whole before anything is
restored; no pickle is ever loaded."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from calm_runtime.cli.main import main  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402

pytestmark = pytest.mark.usefixtures("private_calm_cache")
STEP = "step-000002"


def _train(model, data, out, checkpoints, steps, *extra) -> int:
    return main(["-q", "train", "--model", str(model), "--train", f"{data}:train",
                 "--calibration", f"{data}:unlabeled", "--out", str(out), "--steps", str(steps),
                 "--set", "checkpoint_every=2", "--checkpoint-dir", str(checkpoints),
                 "--batch-size", "2", "--lora-rank", "2", "--set", "inner_steps=1",
                 "--max-length", "48", "--set", "optimizer=adam", "--set", "warm_start_steps=1",
                 "--holdout", "0", "--no-daca", *extra])


@pytest.fixture(scope="module")
def checkpoint(tiny_llama_tied, mc_file, tmp_path_factory):
    """A real checkpoint after 2 steps (one warm-start step, one Adam step of the method)."""
    root = tmp_path_factory.mktemp("resume")
    assert _train(tiny_llama_tied, mc_file, root / "first", root / "ckpt", 2) == 0
    assert (root / "ckpt" / STEP / "state.json").is_file()
    shutil.rmtree(root / "first")
    return root / "ckpt"


def _tensors(mutate):
    def apply(folder: Path):
        path = folder / "tensors.safetensors"
        tensors = load_file(str(path))
        mutate(tensors)
        save_file(tensors, str(path))
    return apply


def _state(mutate):
    def apply(folder: Path):
        path = folder / "state.json"
        payload = json.loads(path.read_text())
        mutate(payload)
        path.write_text(json.dumps(payload))
    return apply


def _rename(old, new):
    return _tensors(lambda t: t.__setitem__(new, t.pop(old)))


def _put(name, value):
    return _tensors(lambda t: t.__setitem__(name, value))


def _first(tensors, prefix):
    return next(k for k in sorted(tensors) if k.startswith(prefix))


def _theta_shape(t):
    name = _first(t, "theta/")
    t[name] = torch.zeros(t[name].shape[0] + 1, *t[name].shape[1:])


def _theta_dtype(t):
    name = _first(t, "theta/")
    t[name] = t[name].double()


def _optim_index(index):
    def mutate(t):
        for key in [k for k in t if k.startswith("optim/0/")]:
            t[key.replace("optim/0/", f"optim/{index}/")] = t.pop(key)
    return mutate


def _fifo(folder: Path):
    path = folder / "tensors.safetensors"
    path.unlink()
    os.mkfifo(path)


def _zip(folder: Path):
    # a torch pickle is a zip archive: its first bytes, never loaded
    (folder / "tensors.safetensors").write_bytes(b"PK\x03\x04" + b"\0" * 200)


def _header_length(folder: Path):
    path = folder / "tensors.safetensors"
    raw = path.read_bytes()
    path.write_bytes((len(raw) * 4).to_bytes(8, "little") + raw[8:])


def _truncate(folder: Path):
    path = folder / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:-10])


def _deep(folder: Path):
    (folder / "state.json").write_text("[" * 100_000 + "]" * 100_000)


#: field -> mutation of the checkpoint folder; every one must be refused in one line
MUTATIONS = {
    # tensors.safetensors: names, shapes, dtypes, values
    "theta wrong shape": _tensors(_theta_shape),
    "theta wrong dtype": _tensors(_theta_dtype),
    "theta missing": _tensors(lambda t: t.pop(_first(t, "theta/"))),
    "alpha wrong shape": _put("alpha/log_tau", torch.zeros(7)),
    "alpha not finite": _put("alpha/shift", torch.full((300,), float("nan"))),
    "alpha missing": _tensors(lambda t: t.pop("alpha/shift")),
    "extra tensor": _put("extra/tensor", torch.zeros(3)),
    "rng missing": _tensors(lambda t: t.pop("rng/torch")),
    "rng wrong dtype": _put("rng/torch", torch.zeros(5056)),
    "rng wrong shape": _put("rng/torch", torch.zeros(17, dtype=torch.uint8)),
    # the optimizer's entries: index, key, shape, numbers
    "optimizer index not an integer": _rename("optim/0/step", "optim/x/step"),
    "optimizer index missing": _rename("optim/0/step", "optim/step"),
    "optimizer index 10^18": _tensors(_optim_index(10 ** 18)),
    "optimizer index 99,999": _tensors(_optim_index(99_999)),
    "optimizer key unknown": _rename("optim/0/exp_avg", "optim/0/other"),
    "optimizer entry missing": _tensors(lambda t: t.pop("optim/0/exp_avg_sq")),
    "optimizer tensor wrong shape": _put("optim/0/exp_avg", torch.zeros(3)),
    "optimizer step count out of range": _put("optim/0/step", torch.tensor(1e9)),
    "optimizer step count negative": _put("optim/0/step", torch.tensor(-1.0)),
    "optimizer scalar unknown": _state(lambda p: p["optimizer_scalars"].update({"0/x": 1})),
    "optimizer scalar index 10^18": _state(
        lambda p: p["optimizer_scalars"].update({f"{10 ** 18}/step": 1})),
    # the file's format
    "a torch pickle renamed": _zip,
    "header longer than the file": _header_length,
    "truncated": _truncate,
    "a FIFO": _fifo,
    # state.json: structure and numbers
    "step 10^30": _state(lambda p: p.update(step=10 ** 30)),
    "step 10^20": _state(lambda p: p.update(step=10 ** 20)),
    "step negative": _state(lambda p: p.update(step=-1_000_000)),
    "step past the run's steps": _state(lambda p: p.update(step=5)),
    "step not the folder's": _state(lambda p: p.update(step=1)),
    "step a string": _state(lambda p: p.update(step="2")),
    "step missing": _state(lambda p: p.pop("step")),
    "format a string": _state(lambda p: p.update(format="1")),
    "extra key": _state(lambda p: p.update(extra=1)),
    "theta_names missing": _state(lambda p: p.pop("theta_names")),
    "theta_names wrong": _state(lambda p: p["theta_names"].reverse()),
    "config a list": _state(lambda p: p.update(config=[])),
    "history a dict": _state(lambda p: p.update(history={})),
    "history row of another step": _state(lambda p: p["history"][0].update(step=7)),
    "history q a string": _state(lambda p: p["history"][1].update(q="high")),
    "history short": _state(lambda p: p["history"].pop()),
    "seconds negative": _state(lambda p: p.update(seconds=-1.0)),
    "seconds a string": _state(lambda p: p.update(seconds="12")),
    "nested deeply": _deep,
    "not JSON": lambda folder: (folder / "state.json").write_text("{not json"),
}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else "other"
            for p in sorted(root.rglob("*"))}


#: run in a process of its own (a loader blocked in open() may hold the GIL): a reader that
#: would block on the FIFO gets an end of file after a while, so that a loader that opens it
#: fails the test instead of hanging it
UNBLOCK = """import os, sys, time
while True:
    time.sleep(3)
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
"""


@pytest.mark.parametrize("field", sorted(MUTATIONS))
def test_a_mutated_checkpoint_is_one_line_and_nothing_is_restored_or_written(
        checkpoint, tiny_llama_tied, mc_file, tmp_path, capsys, field):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    MUTATIONS[field](folder / STEP)
    before = _snapshot(folder)
    fifo = folder / STEP / "tensors.safetensors"
    watchdog = (subprocess.Popen([sys.executable, "-c", UNBLOCK, str(fifo)])
                if os.path.lexists(fifo) and stat.S_ISFIFO(os.lstat(fifo).st_mode) else None)
    try:
        code = _train(tiny_llama_tied, mc_file, tmp_path / "out", folder, 4, "--resume")
    finally:
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 1 and len(err) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert err[0].startswith(("ArtifactError: checkpoint", "ConfigError: cannot resume")), err
    if err[0].startswith("ArtifactError"):
        assert err[0].endswith("start without --resume or from a checkpoint of this run"), err
    assert not (tmp_path / "out").exists()
    assert _snapshot(folder) == before


@pytest.mark.parametrize("recorded", [True, False], ids=["with-seconds", "before-seconds"])
def test_the_valid_checkpoint_resumes(checkpoint, tiny_llama_tied, mc_file, tmp_path, capsys,
                                      recorded):
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint, folder)
    assert json.loads((folder / STEP / "state.json").read_text())["seconds"] > 0
    # a long first run (its time as recorded), or one written before the time was kept
    _state(lambda p: p.update(seconds=1000.0) if recorded else p.pop("seconds"))(folder / STEP)
    saved = 1000.0 if recorded else 0.0
    assert _train(tiny_llama_tied, mc_file, tmp_path / "out", folder, 4, "--resume") == 0, \
        capsys.readouterr().err
    assert (tmp_path / "out").is_dir()
    # the training time counts the steps before the resume
    trained = CalibrationAdapter.from_pretrained(tmp_path / "out").metrics["training"]
    assert trained["steps"] == 4 and saved < trained["seconds"] < saved + 600
