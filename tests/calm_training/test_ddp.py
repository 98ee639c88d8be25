"""`calm train` under torchrun (2 CPU processes, gloo) equals one process on the same batch.

The two ranks each take half of every global batch and average values and gradients with
an all-reduce before λ and the step are computed; one process computes the same global
batch in two micro-batches (gradient accumulation). Only float summation order differs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from calm_runtime.formats.artifact import CalibrationAdapter  # noqa: E402
from calm_training.methods.calm.config import CalmConfig  # noqa: E402
from calm_training.methods.calm.trainer import train_calm  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available in this build")

WORDS = "red blue green cat dog sun moon water fire earth stone tree river cloud".split()
#: float32 sums in another order, amplified a little by Adam over 3 steps (measured ~1e-7)
ATOL = 1e-5
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_match_one(tiny_llama_tied, tmp_path):
    from safetensors.torch import load_file

    rng = np.random.default_rng(1)
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(
        {"question": f"which is {w[0]} number {i}?", "choices": [str(x) for x in w],
         "answer": int(rng.integers(0, 4))}) + "\n"
        for i, w in enumerate(rng.choice(WORDS, size=4, replace=False) for _ in range(30))))
    settings = {"steps": 3, "batch_size": 4, "inner_steps": 2, "lora_rank": 2,
                "inner_lr": 0.02, "outer_lr": 1e-2, "max_length": 48,
                # α written as trained: the comparison is of α (the gate: test_alpha_gate)
                "holdout": 0.0}
    env = {**os.environ, "CALM_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port",
               str(_free_port()), "-m", "calm_runtime.cli.main", "-q", "train",
               "--model", str(tiny_llama_tied), "--train", f"{data}:train",
               "--calibration", f"{data}:unlabeled", "--out", str(tmp_path / "ddp"),
               "--set", "lora_targets=q_proj,v_proj", "--set", "device=cpu"]
    for key, value in settings.items():
        command += (["--holdout", str(value)] if key == "holdout"
                    else ["--set", f"{key}={value}"])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    assert done.returncode == 0, done.stderr[-8000:]

    with pytest.MonkeyPatch.context() as patch:  # restores the caller's CALM_CACHE
        patch.setenv("CALM_CACHE", env["CALM_CACHE"])
        config = CalmConfig(model=str(tiny_llama_tied), train=(f"{data}:train",),
                            calibration=(f"{data}:unlabeled",), lora_targets=("q_proj", "v_proj"),
                            grad_accumulation=2, device="cpu", **settings)
        single = train_calm(config, tmp_path / "single", progress=False)

    ddp = CalibrationAdapter.from_pretrained(tmp_path / "ddp")
    assert ddp.provenance["world_size"] == 2 and single.adapter.provenance["world_size"] == 1
    for name in ("tau", "shift"):
        a, b = getattr(ddp, name), getattr(single.adapter, name)
        assert np.abs(a - b).max() <= ATOL, f"{name}: max diff {np.abs(a - b).max():.3g}"
    assert np.ptp(ddp.shift) > 0  # the comparison is not between two untouched vectors
    lora_ddp = load_file(str(ddp.lora_path / "adapter_model.safetensors"))
    lora_one = load_file(str(single.out / "lora" / "adapter_model.safetensors"))
    assert lora_ddp.keys() == lora_one.keys()
    for key in lora_ddp:
        diff = float((lora_ddp[key] - lora_one[key]).abs().max())
        assert diff <= ATOL, f"{key}: max diff {diff:.3g}"
    for key in ("f", "g", "q", "lam"):
        a, b = ddp.metrics["training"]["last"][key], single.history[-1][key]
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), key


def _late_looker(rank: int, port: int, folder: str, failures) -> None:
    """One rank of a gloo group of two: rank 0 writes the final checkpoint, rank 1 looks as
    late as it can (once the checkpoint is on disk, or after 3 s where rank 0 waits for
    its word first): the order that once left the ranks' barriers paired wrongly."""
    import time
    from pathlib import Path
    from types import SimpleNamespace

    from calm_training.methods.calm import checkpoint
    from calm_training.methods.calm.model import Ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    ranks = Ranks("cpu")
    state = Path(folder) / "step-000003" / "state.json"

    def save(trainer, where):
        where.mkdir(parents=True)
        (where / "state.json").write_text("{}")

    checkpoint.save_checkpoint = save  # this process's own copy of the module
    trainer = SimpleNamespace(checkpoint_dir=Path(folder), step=3, dist=ranks,
                              made_final_checkpoint=None)
    try:
        if rank == 1:
            deadline = time.monotonic() + 3
            while not state.is_file() and time.monotonic() < deadline:
                time.sleep(0.01)
        checkpoint.final_checkpoint(trainer)
        # every rank made it and took the same barriers: one more pairs up, then a sum
        ranks.barrier()
        total = ranks.reduce(torch.ones(1)) * 2
        if trainer.made_final_checkpoint is None or float(total) != 2.0:
            failures.put(f"rank {rank}: {trainer.made_final_checkpoint} {float(total)}")
    finally:
        ranks.close()


def test_the_final_checkpoint_is_rank_0s_decision(tmp_path):
    """Rank 1 finding the checkpoint rank 0 has just written still takes rank 0's barrier."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    failures = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_late_looker, args=(rank, port, str(tmp_path), failures))
               for rank in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT_S / 2)
    for worker in workers:
        worker.kill()  # a rank left waiting on a barrier nobody pairs
    assert [w.exitcode for w in workers] == [0, 0]
    assert failures.empty(), failures.get()
