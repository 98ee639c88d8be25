"""CALM training checkpoints: safetensors for tensors, JSON for the rest, written atomically.

A checkpoint is a folder ``step-NNNNNN`` holding ``tensors.safetensors`` (LoRA tensors
``theta/NAME``, α ``alpha/NAME``, the optimizer state flattened to ``optim/INDEX/KEY``, the
torch RNG state ``rng/torch``) and ``state.json`` (format, step, settings, LoRA tensor
names, the optimizer's non-tensor state, the training history, the training time so far).
No pickle anywhere.
``--resume`` checks a checkpoint as a whole before restoring any of it
(:mod:`calm_training.methods.calm.checkpoint_check`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from calm_runtime.files import atomic_directory
from calm_training.methods.calm.checkpoint_check import (
    CHECKPOINT_FORMAT,
    RESUMABLE_CHANGES,
    read_checkpoint,
    step_number,
)

if TYPE_CHECKING:
    from calm_training.methods.calm.state import TrainingState


__all__ = ["CHECKPOINT_FORMAT", "RESUMABLE_CHANGES", "drop_final_checkpoint",
           "final_checkpoint", "latest_checkpoint", "save_checkpoint", "load_checkpoint"]


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete ``step-NNNNNN`` checkpoint in ``folder``, or None."""
    root = Path(folder)
    # a state.json of any kind marks a checkpoint (one that is not a regular file is then
    # refused in one line by the loader, not skipped for an older checkpoint)
    found = sorted((step_number(p), p) for p in root.glob("step-*")
                   if step_number(p) is not None and os.path.lexists(p / "state.json")) \
        if root.is_dir() else []
    return found[-1][1] if found else None


def save_checkpoint(state: TrainingState, target: Path, keep: int = 2) -> None:
    """Write LoRA, α, optimizer state and RNG (safetensors) plus JSON state, atomically."""
    from safetensors.torch import save_file

    m = state.model
    tensors = {f"theta/{n}": p.detach() for n, p in zip(m.names, m.theta, strict=True)}
    tensors.update({f"alpha/{n}": a.detach() for n, a in zip(m.alpha_names, m.alpha, strict=True)})
    optim = state.optimizer.state_dict()
    scalars = {}
    for index, entry in optim["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim/{index}/{key}"] = value
            else:
                scalars[f"{index}/{key}"] = value
    tensors["rng/torch"] = torch.get_rng_state()
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    payload = {"format": CHECKPOINT_FORMAT, "step": state.step,
               "config": state.config.to_dict(), "theta_names": m.names,
               "optimizer_scalars": scalars, "history": state.history,
               "seconds": round(state.seconds, 3)}
    with atomic_directory(target, overwrite=True) as staging:
        save_file(tensors, str(staging / "tensors.safetensors"))
        (staging / "state.json").write_text(json.dumps(payload, indent=1) + "\n")
    mine = step_number(target)
    old = sorted((step_number(p), p) for p in target.parent.glob("step-*")
                 if p != target and step_number(p) is not None and mine is not None
                 and step_number(p) < mine)
    for _, stale in old[:max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(state: TrainingState, folder: Path) -> None:
    """Restore a :func:`save_checkpoint` folder into ``state``: the whole checkpoint is
    read and checked against the model, optimizer and settings being resumed first
    (:func:`~calm_training.methods.calm.checkpoint_check.read_checkpoint`, one line on anything that
    does not match), and only then is any state restored."""
    checked = read_checkpoint(state, folder)
    m = state.model
    with torch.no_grad():
        for p, value in zip(m.theta, checked.theta, strict=True):
            p.copy_(value)
        for a, value in zip(m.alpha, checked.alpha, strict=True):
            a.copy_(value)
    groups = checked.optimizer.state_dict()["param_groups"]
    checked.optimizer.load_state_dict({"state": checked.optimizer_state,
                                       "param_groups": groups})
    torch.set_rng_state(checked.rng)
    state.step = checked.step  # which optimizer is active depends on the step
    state.history = checked.history
    state.seconds = checked.seconds


def final_checkpoint(state: TrainingState) -> Path | None:
    """The checkpoint of ``state``'s last step, written before the finished training is
    measured (unless ``checkpoint_every`` already wrote it; then it is not this run's to
    remove); None without a checkpoint directory."""
    if state.checkpoint_dir is None:
        return None
    folder = state.checkpoint_dir / f"step-{state.step:06d}"
    # rank 0 looks and says: a rank that looked after rank 0 wrote it would skip the
    # barrier below and leave the ranks' barriers paired wrongly
    if not state.dist.rank0s((folder / "state.json").is_file()):
        if state.dist.rank == 0:
            save_checkpoint(state, folder)
        state.dist.barrier()
        state.made_final_checkpoint = folder
    return folder


def drop_final_checkpoint(state: TrainingState, folder: Path | None) -> None:
    """Remove the checkpoint :func:`final_checkpoint` wrote once the adapter is written
    (checkpoints the run asked for stay), and the checkpoint folder if it is then empty."""
    if folder is None or state.made_final_checkpoint != folder:
        return
    shutil.rmtree(folder, ignore_errors=True)
    try:
        state.checkpoint_dir.rmdir()
    except OSError:
        pass  # other checkpoints are there
