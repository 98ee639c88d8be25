"""The model side of CALM training: peft LoRA (θ), α, objectives at answer positions, ranks.

Private to :mod:`calm_training.trainer`; imports torch, peft and transformers.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from calm_runtime.calibration import apply_calibration
from calm_runtime.errors import ConfigError

__all__ = ["AnswerHead", "CalmModel", "Ranks", "pick_device"]


class AnswerHead(torch.nn.Module):
    """Decoder hidden states at the flat answer positions, through the LM head only there."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)

    def forward(self, input_ids, attention_mask, flat_positions):
        out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False)
        hidden = out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_positions)
        z = self.lm.get_output_embeddings()(hidden).float()
        if self.softcap:
            z = (z / self.softcap).tanh() * self.softcap
        return z


class CalmModel:
    """The peft model, its LoRA leaves (θ), α, and the objectives at answer positions."""

    def __init__(self, config, device) -> None:
        from peft import LoraConfig, get_peft_model

        from calm_runtime.models import load_model_and_tokenizer, resolve_model

        lm, self.tokenizer, self.identity = load_model_and_tokenizer(config.model)
        self.folder = resolve_model(config.model)
        torch.manual_seed(config.seed)
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                          target_modules=list(config.lora_targets), bias="none")
        try:
            self.peft = get_peft_model(lm, lora)
        except ValueError as exc:
            raise ConfigError(f"cannot attach LoRA to {config.model} ({exc}); check "
                              "--lora-targets against the model's module names") from None
        self.peft.to(device).eval()
        self.lm = lm
        self.head = AnswerHead(lm)
        named = [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.theta = [p for _, p in named]
        vocab = self.identity.vocab_size
        if config.method == "scalar":
            self.alpha_names = ["log_temperature"]
            self.alpha = [torch.zeros(1, device=device, requires_grad=True)]
        elif config.method == "lora":
            self.alpha_names, self.alpha = [], []
        else:
            self.alpha_names = ["log_tau", "shift"]
            self.alpha = [torch.zeros(vocab, device=device, requires_grad=True)
                          for _ in range(2)]

    def logits(self, theta, batch):
        """Float32 logits ``[P, V]`` at the batch's positions for LoRA values ``theta``."""
        from torch.func import functional_call

        return functional_call(self.head, dict(zip(self.names, theta, strict=True)),
                               (batch.input_ids, batch.attention_mask, batch.flat_positions),
                               strict=False)

    @staticmethod
    def calibrate(z, alpha):
        """``z_α``: the calibration formula of calm_runtime with ``tau = exp(log_tau)``."""
        if len(alpha) == 2:
            return apply_calibration(z, torch.exp(alpha[0]), alpha[1])
        if len(alpha) == 1:
            return apply_calibration(z, torch.exp(alpha[0]))
        return z

    def tau_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tau, shift)`` float32 ``[V]`` as the artifact stores them; ``tau`` is the same
        ``torch.exp(log_tau)`` the training computed, so the artifact reproduces it exactly."""
        vocab = self.identity.vocab_size
        with torch.no_grad():
            if len(self.alpha) == 2:
                return (torch.exp(self.alpha[0]).float().cpu().numpy(),
                        self.alpha[1].float().cpu().numpy())
            tau = (torch.exp(self.alpha[0]).float().cpu().expand(vocab) if self.alpha
                   else torch.ones(vocab))
            return tau.numpy().copy(), np.zeros(vocab, np.float32)

    def objective(self, batches, loss: str):
        """An :data:`~calm_training.bilevel.Objective` summed over micro-``batches`` (their
        weights already divide by the rank's example count): ``ce`` or ``neg_entropy``."""

        def objective(theta, alpha, grad_theta, grad_alpha):
            wrt = [*(theta if grad_theta else ()), *(alpha if grad_alpha else ())]
            total = torch.zeros((), dtype=torch.float64)
            grads = None
            for batch in batches:
                with torch.set_grad_enabled(bool(wrt)):
                    logp = self.calibrate(self.logits(theta, batch), alpha).log_softmax(-1)
                    if loss == "ce":
                        per = -logp.gather(1, batch.targets.clamp(min=0)[:, None]).squeeze(1)
                    else:
                        per = (logp.exp() * logp).sum(-1)
                    value = (per * batch.weights).sum()
                total += value.detach().double().cpu()
                if wrt:
                    parts = torch.autograd.grad(value, wrt, allow_unused=True)
                    parts = [torch.zeros_like(w) if p is None else p
                             for w, p in zip(wrt, parts, strict=True)]
                    grads = parts if grads is None else [
                        a + b for a, b in zip(grads, parts, strict=True)]
            n = len(theta) if grad_theta else 0
            return (total, grads[:n] if grad_theta else None,
                    grads[n:] if grad_alpha else None)

        return objective


class Ranks:
    """Rank, world size and the mean-over-ranks reduction (identity in one process)."""

    def __init__(self, device_type: str) -> None:
        import torch.distributed as dist

        self.dist, self.owned = dist, False
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
            self.owned = True
        active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if active else 0
        self.world = dist.get_world_size() if active else 1

    def reduce(self, vector):
        if self.world == 1:
            return vector
        self.dist.all_reduce(vector)
        return vector / self.world

    def barrier(self) -> None:
        if self.world > 1:
            self.dist.barrier()

    def close(self) -> None:
        if self.owned:
            self.dist.destroy_process_group()


def pick_device(config):
    if config.device:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
