"""CALM training (docs/methods.md §4): a LoRA adapter and per-vocabulary α = (log_tau, l).

:func:`train_calm` loads the model, wraps it with a peft LoRA, and runs ``config.steps``
outer steps of the chosen method (:data:`METHODS`) with the step functions of
:mod:`.bilevel`, then writes a calibration adapter of kind ``calm`` (or the
ablation's kind): ``tau = exp(log_tau)``, ``shift = l``, ``temperature = 1``, the peft LoRA
folder, provenance and the training curve.

* Only the logits that a loss reads are computed: the decoder's hidden states are gathered
  at the answer positions and only those rows go through the LM head (full vocabulary, as
  α's gradient needs). The calibrated logits are
  ``apply_calibration(z, exp(log_tau), l)`` — the one formula of
  :mod:`calm_runtime.calibration`.
* ``θ~`` is a copy of the LoRA tensors only; the model is evaluated at any LoRA values with
  :func:`torch.func.functional_call`, never by copying the base model.
* Data parallel: under ``torchrun`` every rank loads the same records, takes its shard
  (``rank::world``) of each global batch, and every objective value and gradient is
  averaged over ranks (one all-reduce of one flat vector) before ``λ`` and ``d`` are
  computed, so all ranks take the same step as one process on the global batch would.
  (DDP's module wrapper is not used: BOME needs gradients at ``θ~`` and w.r.t. α, which it
  cannot synchronise.) Backend: gloo on CPU, nccl on GPU.
* Checkpoints (every ``checkpoint_every`` steps, rank 0): a folder ``step-NNNNNN`` with
  ``tensors.safetensors`` (LoRA, α, optimizer state flattened, torch RNG state) and
  ``state.json`` (step, settings, history), written atomically. ``resume=True`` continues
  from the newest one bit for bit (the batches are a fixed function of seed and step).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from calm_runtime import modes
from calm_runtime.errors import ConfigError, FitError
from calm_runtime.formats.artifact import CalibrationAdapter
from calm_training.methods import upper_objective
from calm_training.methods.calm import data as calm_data
from calm_training.methods.calm.config import (
    ALPHA_TOKENS,
    METHODS,
    OPTIMIZERS,
    PHI_MODES,
    UPPER_PARAMS,
    CalmConfig,
)
from calm_training.methods.calm.gate import held_out
from calm_training.methods.calm.state import TrainingState

__all__ = ["METHODS", "OPTIMIZERS", "PHI_MODES", "UPPER_PARAMS", "ALPHA_TOKENS", "CalmConfig",
           "TrainResult", "train_calm", "latest_checkpoint"]

logger = logging.getLogger(__name__)

@dataclass
class TrainResult:
    """The adapter written (rank 0; built but not written on other ranks) and the curve."""

    adapter: CalibrationAdapter
    history: list[dict] = field(default_factory=list)
    out: Path | None = None
    seconds: float = 0.0
    #: the trained in-memory model (peft LoRA, θ, α) for further use in the same process
    model: object = field(default=None, repr=False)
    #: ``(tau, shift)`` as trained, before the α gate (None for methods without α)
    trained_alpha: tuple | None = field(default=None, repr=False)
    #: the α gate's measures and decision (``method["alpha_gate"]`` of the adapter)
    alpha_gate: dict | None = None
    #: the DACA temperature against the base (``method["daca"]``; calm_training.methods.calm.finish)
    daca: dict | None = None


# ---------------------------------------------------------------------------- training
def latest_checkpoint(folder: str | os.PathLike):
    """The newest checkpoint folder in ``folder`` (``<out>.checkpoints``), or None."""
    from calm_training.methods.calm.checkpoint import latest_checkpoint as latest

    return latest(folder)


def train_calm(config: CalmConfig, out: str | os.PathLike | None, *, resume: bool = False,
               overwrite: bool = False, checkpoint_dir: str | os.PathLike | None = None,
               progress: bool = True) -> TrainResult:
    """Train per ``config``; write the adapter to ``out`` (rank 0, atomically; None: don't).

    ``checkpoint_dir`` defaults to ``<out>.checkpoints``; ``resume`` continues from its
    newest checkpoint (the settings must match, except ``steps``, ``checkpoint_every``, ``device``).
    """
    if out is not None and Path(out).exists() and not overwrite:
        raise ConfigError(f"{out} already exists; choose another --out or pass --overwrite")
    if checkpoint_dir is None and out is not None:
        checkpoint_dir = Path(out).with_name(Path(out).name + ".checkpoints")
    from calm_training.methods.calm.model import Ranks, pick_device

    device = pick_device(config)
    dist = Ranks(device)
    try:
        return _Trainer(config, device, dist, checkpoint_dir).run(out, resume, overwrite,
                                                                  progress)
    finally:
        dist.close()


def q_grew_fix(config) -> str:
    """What to change when q grows: the settings that slow the outer steps, never the one
    the run already has."""
    fixes = ([] if config.optimizer == "sgd" else ["--set optimizer=sgd"]) + [
        "a smaller --set outer_lr", "a larger --set eta"]
    return "use " + ", ".join(fixes[:-1]) + " or " + fixes[-1]


class _Trainer:
    def __init__(self, config: CalmConfig, device, dist, checkpoint_dir) -> None:
        import torch

        from calm_training.methods.calm.bilevel import BomeOptions
        from calm_training.methods.calm.model import CalmModel
        from calm_training.scoring.local import padding_id, uses_chat_template

        per_step = dist.world * config.grad_accumulation
        for name, size in (("batch_size", config.batch_size),
                           ("calibration_batch_size", config.cal_batch_size)):
            if size % per_step:
                raise ConfigError(f"{name} {size} is not divisible by world size {dist.world} "
                                  f"x grad_accumulation {config.grad_accumulation}; every rank "
                                  "and micro-batch must get the same number of examples")
        self.config, self.device, self.dist = config, device, dist
        #: what the method and the upper objective decide (calm_training.methods)
        self.method = config.train_method
        self.upper = upper_objective(config.upper)
        self.model = CalmModel(config, device)
        chat = (modes.mode(config.mode).chat_prompts
                and uses_chat_template(self.model.tokenizer, config.chat))
        train, self.train_info = calm_data.load_records(config.train, labeled=True,
                                                        limit=config.limit)
        cal, self.cal_info = calm_data.load_records(config.calibration, labeled=False,
                                                    limit=config.limit)
        encode = {"tokenizer": self.model.tokenizer, "mode": config.mode, "chat": chat,
                  "max_length": config.max_length}
        # training questions held out of training for the gate of α and T (calm.gate)
        self.cal_records = cal
        held, train = held_out(config, train, bool(self.model.alpha), encode)
        self.holdout_records, self.holdout_examples, self.holdout_kind, self.holdout_info = held
        # CFT reads every option of a training question; the other methods its answer only
        self.train_examples = (
            calm_data.encode_labeled_options(train, **encode, variant=config.cloze_variant)
            if self.method.reads_all_options else calm_data.encode_training(train, **encode))
        self.cal_examples = calm_data.encode_calibration(
            cal, **encode, positions=config.calibration_positions, entropy=config.entropy,
            variant=config.cloze_variant)
        if self.upper.needs_reference:
            from calm_training.methods.calm.reference import reference_option_probs, with_reference

            probs = reference_option_probs(config.reference, cal, mode=config.mode,
                                           variant=config.cloze_variant, chat=config.chat,
                                           max_length=config.max_length,
                                           dtype=config.dtype, device=str(device))
            self.cal_examples = with_reference(self.cal_examples, probs)
        self.cft = None
        if config.alpha_tokens == "options":
            self.model.restrict_alpha(calm_data.answer_token_ids(
                [*train, *cal], self.model.tokenizer, mode=config.mode, chat=chat))
        if config.init_lora is not None:
            self.model.load_lora(_lora_folder(config.init_lora))
        self.pad = padding_id(self.model.tokenizer)
        if self.method.reads_all_options:  # CFT's E-step: bin accuracies of the starting model
            self.cft = {"bins": self._cft_bins(), "weight": config.cft_weight,
                        "scale": config.cft_scale, "global_batch": config.batch_size}
        groups = [{"params": self.model.theta, "lr": config.theta_lr}]
        if self.model.alpha:
            groups.append({"params": self.model.alpha, "lr": config.alpha_step_lr})
        self.state = TrainingState(
            config=config, model=self.model, dist=dist,
            outer_optimizer=(torch.optim.Adam(groups) if config.optimizer == "adam" else
                             torch.optim.SGD(groups, momentum=config.momentum)),
            warm_optimizer=(torch.optim.Adam(self.model.theta, lr=config.warm_start_lr)
                            if config.warm_steps else None),
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None)
        self.options = BomeOptions(inner_steps=config.inner_steps,
                                   inner_lr=config.inner_step_lr,
                                   inner_optimizer=config.inner_optimizer,
                                   eta=config.eta, phi=config.phi,
                                   epsilon=CalmConfig.LAMBDA_EPSILON,
                                   upper_theta=config.upper_params == "all")
        self.q_warnings = 0
        if config.checkpoint_every and self.state.checkpoint_dir is None:
            logger.warning("checkpoint_every=%d but no checkpoint directory (no --out); no "
                           "checkpoints will be written", config.checkpoint_every)

    def _batches(self, examples, batch_size: int, stream: int):
        idx = calm_data.batch_indices(len(examples), batch_size, self.state.step,
                                      self.config.seed, stream)[self.dist.rank::self.dist.world]
        return [calm_data.collate([examples[i] for i in chunk], len(idx), self.pad)
                .to(self.device) for chunk in np.array_split(idx, self.config.grad_accumulation)]

    def _cft_bins(self):
        """Confidence-bin accuracies and sizes of the training split at the starting θ."""
        import torch

        from calm_training.methods.calm.cft import estimate_bins
        from calm_training.methods.calm.model import option_log_probs, stack_option_rows

        # the micro-batch size of training: what fits in memory there fits here
        m = self.model
        size = max(1, self.config.batch_size // (self.dist.world * self.config.grad_accumulation))
        probs, labels = [], []
        with torch.no_grad():
            for start in range(0, len(self.train_examples), size):
                chunk = self.train_examples[start:start + size]
                batch = calm_data.collate(chunk, len(chunk), self.pad).to(self.device)
                logp = m.calibrate(m.logits([t.detach() for t in m.theta], batch),
                                   m.alpha).log_softmax(-1)
                probs += list(option_log_probs(logp, batch).exp().double().cpu().numpy())
                labels += batch.labels.tolist()
        bins = estimate_bins(stack_option_rows(probs, 0.0), np.asarray(labels),
                             self.config.cft_bins)
        logger.info("cft: training-split bin accuracies %s (sizes %s)",
                    [round(a, 3) for a in bins.accuracy], list(bins.count))
        return bins

    def one_step(self) -> dict:
        import torch

        from calm_training.methods.calm.bilevel import descent_step

        cfg, m = self.config, self.model
        m.cft_parts = {"ce": 0.0, "l_cal": 0.0}
        lower = m.objective(self._batches(self.train_examples, cfg.batch_size, 0),
                            self.method.lower_loss, cft=self.cft)
        upper = m.objective(self._batches(self.cal_examples, cfg.cal_batch_size, 1),
                            self.upper.loss(cfg.entropy), alpha_l2=cfg.alpha_l2)
        reduce = self.dist.reduce
        warming = self.state.warming
        phase = "warm-start" if warming else cfg.method
        g_identity = None  # g with α at the identity (comparable with plain LoRA's g)
        if m.alpha and not warming:
            identity = [a.detach().new_zeros(a.shape) for a in m.alpha]
            value, _, _ = lower([t.detach() for t in m.theta], identity, False, False)
            value = value.reshape(1).to(device=m.theta[0].device, dtype=torch.float64)
            g_identity = float(reduce(value)[0])
        if warming:  # plain LoRA steps before the method's own
            stats = descent_step(m.theta, m.alpha, lower, upper, self.state.optimizer,
                                 reduce=reduce)
        else:
            stats = self.method.solver.step(m.theta, m.alpha, lower, upper, self.state.optimizer,
                                            self.options, beta=cfg.beta, reduce=reduce)
        if g_identity is None:
            g_identity = stats.g
        self.state.step += 1
        tau, shift = m.tau_shift()
        if self.cft:  # this rank's parts of g (the CE and L_cal of its share of the batch)
            stats = {**stats.to_dict(), "cft_ce": m.cft_parts["ce"],
                     "cft_l_cal": m.cft_parts["l_cal"]}
        else:
            stats = stats.to_dict()
        return {"step": self.state.step, "phase": phase, **stats, "g_identity": g_identity,
                "tau_min": float(tau.min()), "tau_max": float(tau.max()),
                "tau_mean": float(tau.mean()), "shift_min": float(shift.min()),
                "shift_max": float(shift.max()), "shift_mean": float(shift.mean())}

    def _watch_q(self, row: dict) -> None:
        """Warn when q grew: mean over the last ``q_window`` steps above the window before."""
        n = self.config.q_window
        qs = [r["q"] for r in self.state.history if r.get("q") is not None]
        if row.get("q") is None or len(qs) < 2 * n or len(qs) % n:
            return
        before, last = float(np.mean(qs[-2 * n:-n])), float(np.mean(qs[-n:]))
        if last > before:
            self.q_warnings += 1
            logger.warning("step %d: q grew from %.3g to %.3g (mean over %d steps): the outer "
                           "steps are leaving the lower-level optimum; %s", row["step"],
                           before, last, n, q_grew_fix(self.config))

    def run(self, out, resume: bool, overwrite: bool, progress: bool) -> TrainResult:
        from tqdm.auto import tqdm

        cfg = self.config
        if resume:
            self._load_latest()
        before, started = self.state.seconds, time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.state.step, desc=f"calm {cfg.method}",
                   unit="step",
                   disable=not progress or self.dist.rank != 0)
        warned = False
        self.inner_increases = sum(1 for r in self.state.history if (r.get("q") or 0) < 0)
        while self.state.step < cfg.steps:
            row = self.one_step()
            self.state.history.append(row)
            for key in ("f", "g", "q", "lam", "tau_min", "tau_max", "shift_min", "shift_max"):
                value = row[key]
                if value is not None and not math.isfinite(value):
                    raise FitError(f"step {row['step']}: {key} is {value}; training diverged, "
                                   "lower the learning rates; nothing was written")
            if self.dist.rank == 0:
                logger.info("step %d/%d %s", row["step"], cfg.steps, _log_line(row))
                self._watch_q(row)
            if row["q"] is not None and row["q"] < 0 and self.dist.rank == 0:
                self.inner_increases += 1
                if not warned:
                    warned = True
                    logger.warning("step %d: g(θ~) > g(θ) (q = %.3g < 0): the inner steps "
                                   "increased g; lower --set inner_lr (now %g)", row["step"],
                                   row["q"], cfg.inner_step_lr)
            bar.set_postfix_str(_log_line(row, short=True), refresh=False)
            bar.update(1)
            self.state.seconds = before + time.perf_counter() - started
            if cfg.checkpoint_every and self.state.step % cfg.checkpoint_every == 0:
                self._save_checkpoint()
        bar.close()
        seconds = self.state.seconds
        trained_alpha = self.model.tau_shift() if self.model.alpha else None
        # the finished training is checkpointed before anything measures it, so that a
        # measurement that fails loses nothing: `--resume` writes the adapter from there
        from calm_training.methods.calm.checkpoint import drop_final_checkpoint, final_checkpoint

        final = final_checkpoint(self.state) if out is not None else None
        try:
            self.alpha_gate = self._alpha_gate()
            adapter = self._adapter(seconds)
        except Exception as exc:
            logger.debug("measuring the finished training failed", exc_info=True)
            where = (f"the trained state is kept in {final}; fix the cause and rerun the same "
                     "command with --resume" if final is not None else "nothing was written")
            raise FitError(f"training finished but measuring it failed "
                           f"({type(exc).__name__}: {exc}); {where}") from exc
        daca = None
        if out is not None and self.dist.rank == 0:
            from calm_training.methods.calm.finish import PENDING, finish

            adapter.method["daca"] = dict(PENDING)  # until finish writes T's record
            with tempfile.TemporaryDirectory(prefix="calm-lora-") as tmp:
                self.model.peft.save_pretrained(tmp)
                adapter.lora_path = Path(tmp)
                adapter.save_pretrained(out, overwrite=overwrite)
            logger.info("wrote %s (kind %s) after %d steps in %.0f s", out, adapter.kind,
                        self.state.step, seconds)
            # the training is on disk now; what follows only adds to it
            adapter, daca = finish(cfg, Path(out), self.cal_records, self.holdout_records,
                                   progress=progress)
            drop_final_checkpoint(self.state, final)
        self.dist.barrier()
        return TrainResult(adapter=adapter, history=self.state.history,
                           out=Path(out) if out is not None else None, seconds=seconds,
                           model=self.model, trained_alpha=trained_alpha,
                           alpha_gate=self.alpha_gate, daca=daca)

    def _alpha_gate(self) -> dict | None:
        """Measure α's own effect on the hold-out's deciding half and reset α to the identity
        unless the gate keeps it (calm.gate.decide_part); None for methods without α."""
        from calm_training.methods.calm.alpha_gate import measure_alpha_share, measure_answer_nll
        from calm_training.methods.calm.gate import decide_part

        if not self.model.alpha:
            return None
        share = None
        if self.holdout_examples is not None:
            size = max(1, self.config.batch_size
                       // (self.dist.world * self.config.grad_accumulation))
            measure = (measure_alpha_share if self.holdout_kind == "options"
                       else measure_answer_nll)
            share = measure(self.model, self.holdout_examples, self.pad, size)
        if share is None:
            keep, why, decision = True, ("no hold-out (--holdout 0): α written as trained, "
                                         "unmeasured"), None
        else:
            q = share["questions"]
            correct = ((q["correct_alpha"], q["correct_without"])
                       if "correct_alpha" in q else (None, None))
            decision = decide_part("alpha", q["nll_alpha"], q["nll_without"], *correct,
                                   rule="non-inferiority")
            keep, why = decision["kept"], decision["reason"]
            if "flips" in share:
                # flips: predicted answers changed (the decision counts correctness changes)
                why += (f"; α changed {share['flips']} of the {share['n']} deciding questions' "
                        f"predicted answers, TV {share['total_variation']:.4f}")
        if not keep:
            self.model.set_alpha(None, None)
        if self.dist.rank == 0:
            (logger.info if keep else logger.warning)("alpha gate: %s", why)
        return {"kept": keep, "reason": why, "holdout": self.holdout_info, "share": share,
                "decision": decision}

    def coupling(self) -> dict:
        """Whether BOME's coupling engaged (calm_training.methods.calm.bilevel.coupling_summary)."""
        from calm_training.methods.calm.bilevel import coupling_summary

        return coupling_summary(self.state.history, self.config.eta)

    # ------------------------------------------------------------------ artifact
    def _adapter(self, seconds: float) -> CalibrationAdapter:
        import peft
        import torch
        import transformers

        from calm_runtime.data.models import model_fingerprint

        cfg = self.config
        tau, shift = self.model.tau_shift()
        keys = ("step", "phase", "f", "g", "g_identity", "q", "lam", "grad_q_norm",
                "d_dot_grad_q", "cos_f_q", "grad_alpha_q_norm", "grad_alpha_f_norm",
                "inner_move", "tau_min", "tau_max", "shift_min", "shift_max",
                *(("cft_ce", "cft_l_cal") if self.cft else ()))
        history = self.state.history
        every = max(1, math.ceil(len(history) / 50))
        curve = [{k: r.get(k) for k in keys} for r in history[::every]]
        if history and curve[-1]["step"] != history[-1]["step"]:
            curve.append({k: history[-1].get(k) for k in keys})
        centered = self.model.center and bool(self.model.alpha)
        return CalibrationAdapter(
            base_model=self.model.identity, tau=tau, shift=shift, temperature=1.0,
            centered=centered,
            kind="lora" if cfg.freeze_alpha else self.method.kind,
            # "variant" is the cloze score variant, as in every adapter (export and the
            # runtime read it); the CALM solver or ablation is "solver"
            method={"name": "calm", "solver": cfg.method, "mode": cfg.mode,
                    "variant": modes.mode(cfg.mode).recorded_variant(cfg.cloze_variant),
                    "alpha": self.model.alpha_names, "settings": cfg.to_dict(),
                    "alpha_token_count": (None if self.model.alpha_index is None
                                          else int(self.model.alpha_index.numel())),
                    **({"cft_bins": self.cft["bins"].to_dict()} if self.cft else {}),
                    **({"alpha_gate": self.alpha_gate} if self.alpha_gate else {})},
            metrics={"training": {"steps": self.state.step, "seconds": round(seconds, 3),
                                  "q_growth_warnings": self.q_warnings,
                                  "inner_increases": self.inner_increases,
                                  "coupling": self.coupling(),
                                  "first": history[0] if history else None,
                                  "last": history[-1] if history else None,
                                  "curve": curve}},
            provenance={"model": self.model.identity.to_dict(), "model_spec": cfg.model,
                        "model_fingerprint": model_fingerprint(self.model.folder),
                        "train_data": self.train_info, "calibration_data": self.cal_info,
                        "data_split": {"train_fraction": calm_data.TRAIN_SPLIT_FRACTION,
                                       "train_seed": calm_data.TRAIN_SPLIT_SEED},
                        "seed": cfg.seed, "world_size": self.dist.world,
                        "versions": {"torch": torch.__version__, "peft": peft.__version__,
                                     "transformers": transformers.__version__}})

    # ------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self) -> None:
        from calm_training.methods.calm.checkpoint import save_checkpoint

        state = self.state
        if self.dist.rank == 0 and state.checkpoint_dir is not None:
            save_checkpoint(state, state.checkpoint_dir / f"step-{state.step:06d}")
        self.dist.barrier()

    def _load_latest(self) -> None:
        from calm_training.methods.calm.checkpoint import latest_checkpoint, load_checkpoint

        where = self.state.checkpoint_dir
        folder = latest_checkpoint(where) if where else None
        if folder is None:
            raise ConfigError(f"--resume: no checkpoint in {where}; train without "
                              "--resume or point --checkpoint-dir at the run's checkpoints")
        load_checkpoint(self.state, folder)
        logger.info("resumed from %s at step %d", folder, self.state.step)


def _lora_folder(path: str) -> Path:
    """A peft LoRA folder from ``--set init_lora``: the folder itself or a calm adapter's
    ``lora/``."""
    folder = Path(path)
    if (folder / "adapter_model.safetensors").is_file():
        return folder
    if (folder / "calm_adapter.json").is_file():
        lora = CalibrationAdapter.from_pretrained(folder).lora_path
        if lora is None:
            raise ConfigError(f"init_lora {path}: the adapter has no LoRA; give an adapter "
                              "trained with a LoRA (calm train) or a peft folder")
        return Path(lora)
    raise ConfigError(f"init_lora {path}: not a peft LoRA folder (no "
                      "adapter_model.safetensors) nor a calm adapter; check the path")


def _log_line(row: dict, short: bool = False) -> str:
    def num(key, fmt=".4g"):
        return "-" if row.get(key) is None else format(row[key], fmt)

    if short:
        return (f"f={num('f', '.3f')} g={num('g', '.3f')} q={num('q', '.2e')} "
                f"lam={num('lam', '.2g')} tau=[{num('tau_min', '.3f')},{num('tau_max', '.3f')}]")
    return (f"[{row.get('phase', '-')}] f={num('f')} g={num('g')} "
            f"g(identity)={num('g_identity')} q={num('q')} lam={num('lam')} "
            f"<d,grad q>={num('d_dot_grad_q')} cos(grad f,grad q)={num('cos_f_q', '.3f')} "
            f"|grad q|={num('grad_q_norm')} tau=[{num('tau_min')}, {num('tau_max')}] "
            f"l=[{num('shift_min')}, {num('shift_max')}]")
