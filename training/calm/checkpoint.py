"""CALM training checkpoints: safetensors for tensors, JSON for the rest, written atomically.

A checkpoint is a folder ``step-NNNNNN`` holding ``tensors.safetensors`` (LoRA tensors
``theta/NAME``, α ``alpha/NAME``, the optimizer state flattened to ``optim/INDEX/KEY``, the
torch RNG state ``rng/torch``) and ``state.json`` (format, step, settings, LoRA tensor
names, the optimizer's non-tensor state, the training history). No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.files import atomic_directory

__all__ = ["CHECKPOINT_FORMAT", "RESUMABLE_CHANGES", "drop_final_checkpoint",
           "final_checkpoint", "latest_checkpoint", "save_checkpoint", "load_checkpoint"]

CHECKPOINT_FORMAT = 1
#: settings that may change between a checkpoint and its resumption
RESUMABLE_CHANGES = ("steps", "checkpoint_every", "device")


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The newest complete ``step-NNNNNN`` checkpoint in ``folder``, or None."""
    root = Path(folder)
    found = sorted(p for p in root.glob("step-*") if (p / "state.json").is_file()) \
        if root.is_dir() else []
    return found[-1] if found else None


def save_checkpoint(trainer, target: Path, keep: int = 2) -> None:
    """Write LoRA, α, optimizer state and RNG (safetensors) plus JSON state, atomically."""
    from safetensors.torch import save_file

    m = trainer.model
    tensors = {f"theta/{n}": p.detach() for n, p in zip(m.names, m.theta, strict=True)}
    tensors.update({f"alpha/{n}": a.detach() for n, a in zip(m.alpha_names, m.alpha, strict=True)})
    state = trainer.optimizer.state_dict()
    scalars = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"optim/{index}/{key}"] = value
            else:
                scalars[f"{index}/{key}"] = value
    tensors["rng/torch"] = torch.get_rng_state()
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}
    payload = {"format": CHECKPOINT_FORMAT, "step": trainer.step,
               "config": trainer.config.to_dict(), "theta_names": m.names,
               "optimizer_scalars": scalars, "history": trainer.history}
    with atomic_directory(target, overwrite=True) as staging:
        save_file(tensors, str(staging / "tensors.safetensors"))
        (staging / "state.json").write_text(json.dumps(payload, indent=1) + "\n")
    old = sorted(p for p in target.parent.glob("step-*") if p != target and p.name < target.name)
    for stale in old[:max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(trainer, folder: Path) -> None:
    """Restore a :func:`save_checkpoint` folder into ``trainer`` (settings must match)."""
    from safetensors.torch import load_file

    try:
        payload = json.loads((folder / "state.json").read_text())
        tensors = load_file(str(folder / "tensors.safetensors"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"checkpoint {folder} is unreadable ({exc}); delete it to resume "
                            "from an earlier one") from None
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise ArtifactError(f"checkpoint {folder} has format {payload.get('format')!r}, not "
                            f"{CHECKPOINT_FORMAT}; resume with the calm version that wrote it")
    now, then = trainer.config.to_dict(), payload["config"]
    changed = sorted(k for k in set(now) | set(then)
                     if k not in RESUMABLE_CHANGES and now.get(k) != then.get(k))
    if changed:
        raise ConfigError(f"cannot resume from {folder}: settings differ in "
                          + ", ".join(f"{k} ({then.get(k)!r} -> {now.get(k)!r})" for k in changed)
                          + "; use the original settings")
    m = trainer.model
    if payload["theta_names"] != m.names:
        raise ArtifactError(f"checkpoint {folder} holds other LoRA tensors than this model; "
                            "resume with the same model and LoRA settings")
    with torch.no_grad():
        for n, p in zip(m.names, m.theta, strict=True):
            p.copy_(tensors[f"theta/{n}"])
        for n, a in zip(m.alpha_names, m.alpha, strict=True):
            a.copy_(tensors[f"alpha/{n}"])
    trainer.step = int(payload["step"])  # which optimizer is active depends on the step
    state: dict = {}
    for key, value in tensors.items():
        if key.startswith("optim/"):
            _, index, name = key.split("/", 2)
            state.setdefault(int(index), {})[name] = value
    for key, value in payload["optimizer_scalars"].items():
        index, name = key.split("/", 1)
        state.setdefault(int(index), {})[name] = value
    groups = trainer.optimizer.state_dict()["param_groups"]
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng/torch"])
    trainer.step = int(payload["step"])
    trainer.history = list(payload["history"])


def final_checkpoint(trainer) -> Path | None:
    """The checkpoint of ``trainer``'s last step, written before the finished training is
    measured (unless ``checkpoint_every`` already wrote it; then it is not the trainer's to
    remove); None without a checkpoint directory."""
    if trainer.checkpoint_dir is None:
        return None
    folder = trainer.checkpoint_dir / f"step-{trainer.step:06d}"
    # rank 0 looks and says: a rank that looked after rank 0 wrote it would skip the
    # barrier below and leave the ranks' barriers paired wrongly
    if not trainer.dist.rank0s((folder / "state.json").is_file()):
        if trainer.dist.rank == 0:
            save_checkpoint(trainer, folder)
        trainer.dist.barrier()
        trainer.made_final_checkpoint = folder
    return folder


def drop_final_checkpoint(trainer, folder: Path | None) -> None:
    """Remove the checkpoint :func:`final_checkpoint` wrote once the adapter is written
    (checkpoints the run asked for stay), and the checkpoint folder if it is then empty."""
    if folder is None or trainer.made_final_checkpoint != folder:
        return
    shutil.rmtree(folder, ignore_errors=True)
    try:
        trainer.checkpoint_dir.rmdir()
    except OSError:
        pass  # other checkpoints are there
