"""The model side of CALM training: peft LoRA (θ), α, objectives at answer positions, ranks.

Private to :mod:`calm_training.methods.calm.trainer`; imports torch, peft and transformers.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from calm_runtime.calibration import apply_calibration
from calm_runtime.errors import ConfigError
from calm_runtime.inference.post_head import post_head
from calm_training.methods import train_method

__all__ = ["ATTENTION_PROJECTIONS", "AnswerHead", "CalmModel", "Ranks", "default_lora_targets",
           "stack_option_rows",
           "pick_device"]


class AnswerHead(torch.nn.Module):
    """Decoder hidden states at the flat answer positions, through the LM head only there."""

    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm
        self.post = post_head(lm)  # soft cap or logit scaling after the head, as the model does

    def forward(self, input_ids, attention_mask, flat_positions):
        return self.project(self.hidden(input_ids, attention_mask, flat_positions))

    def hidden(self, input_ids, attention_mask, flat_positions):
        """The decoder's last hidden states ``[P, d]`` at the flat positions."""
        out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False)
        hidden = out.last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_positions)

    def project(self, hidden):
        """Logits ``[P, V]`` of hidden states through the LM head and the family's soft cap
        or logit scaling (calm_runtime.inference.post_head), at least in float32 (half precision is
        upcast; float64 stays, for gradient checks)."""
        z = self.lm.get_output_embeddings()(hidden)
        if z.dtype != torch.float64:
            z = z.float()
        return self.post.apply(z)


#: Attention projections by naming scheme, tried in order: Llama-style (Llama, Mistral, Qwen,
#: Gemma, OLMo, Granite, Cohere), fused q/k/v (Phi-3), GPT-NeoX, GPT-2-style, MPT-style.
ATTENTION_PROJECTIONS = (("q_proj", "k_proj", "v_proj", "o_proj"), ("qkv_proj", "o_proj"),
                         ("query_key_value", "dense"), ("c_attn", "c_proj"),
                         ("Wqkv", "out_proj"))


def default_lora_targets(lm) -> list[str]:
    """The LoRA targets when none are given: the model's attention projections."""
    present = {name.rsplit(".", 1)[-1] for name, module in lm.named_modules()
               if isinstance(module, torch.nn.Linear)}
    for scheme in ATTENTION_PROJECTIONS:
        chosen = [name for name in scheme if name in present]
        if len(chosen) == len(scheme):
            return chosen
    kind = getattr(lm.config, "model_type", type(lm).__name__)
    raise ConfigError(f"cannot tell the attention projections of a {kind} model; pass "
                      "--set lora_targets=NAMES with its module names (e.g. q_proj,v_proj)")


class CalmModel:
    """The peft model, its LoRA leaves (θ), α, and the objectives at answer positions."""

    def __init__(self, config, device) -> None:
        from peft import LoraConfig, get_peft_model

        from calm_runtime.data.models import load_model_and_tokenizer, quiet_peft, resolve_model

        lm, self.tokenizer, self.identity = load_model_and_tokenizer(
            config.model, dtype=getattr(config, "dtype", "float32"), device="cpu")
        self.folder = resolve_model(config.model)
        torch.manual_seed(config.seed)
        targets = list(config.lora_targets) or default_lora_targets(lm)
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                          target_modules=targets, bias="none")
        try:
            with quiet_peft():
                self.peft = get_peft_model(lm, lora)
        except ValueError as exc:
            raise ConfigError(f"cannot attach LoRA to {config.model} ({exc}); check "
                              "--set lora_targets=NAMES against the model's module names") from None
        self.peft.to(device).eval()
        self.lm = lm
        self.head = AnswerHead(lm)
        named = [(n, p) for n, p in self.head.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.theta = [p for _, p in named]
        vocab = self.identity.vocab_size
        self.alpha_index = None
        self.cft_parts = {"ce": 0.0, "l_cal": 0.0}
        #: τ divides centred logits (docs/methods.md §1); the adapter records it
        self.center = getattr(config, "alpha_logits", "raw") == "centered"
        # α's variables as the method declares them (calm_training.methods.TrainMethod):
        # none, one learned temperature, or (log_tau, shift) over the vocabulary;
        # freeze_alpha drops them (CalmConfig refuses it for scalar's one temperature)
        names = train_method(config.method).alpha
        if getattr(config, "freeze_alpha", False):
            names = ()
        self.alpha_names = list(names)
        size = 1 if len(names) == 1 else vocab
        self.alpha = [torch.zeros(size, device=device, requires_grad=True) for _ in names]

    def restrict_alpha(self, token_ids) -> None:
        """Train τ, l only at ``token_ids`` (the identity elsewhere); α restarts at identity.
        A no-op for methods without per-vocabulary α."""
        if len(self.alpha) != 2:
            return
        vocab = self.identity.vocab_size
        index = np.unique(np.asarray(list(token_ids), dtype=np.int64))
        if index.size == 0 or index.min() < 0 or index.max() >= vocab:
            raise ConfigError(f"alpha tokens must be ids in [0, {vocab}), got {index.size} "
                              "ids; check the data and the tokenizer")
        device = self.alpha[0].device
        self.alpha_index = torch.as_tensor(index, device=device)
        self.alpha = [torch.zeros(index.size, device=device, requires_grad=True)
                      for _ in range(2)]

    def load_lora(self, folder) -> None:
        """Set θ to the LoRA weights of a peft folder (``adapter_model.safetensors``), which
        must have this model's rank and target modules."""
        from pathlib import Path

        from safetensors.torch import load_file

        path = Path(folder) / "adapter_model.safetensors"
        if not path.is_file():
            raise ConfigError(f"{folder} has no adapter_model.safetensors; point --set init_lora="
                              "at a peft LoRA folder or a calm adapter with a lora/ folder")
        saved = load_file(str(path))
        mine = {}
        for name, param in zip(self.names, self.theta, strict=True):
            key = _peft_key(name)
            if key not in saved:
                raise ConfigError(f"{folder} has no tensor {key}; its LoRA targets differ from "
                                  "--set lora_targets, use the same targets it was trained with")
            if tuple(saved[key].shape) != tuple(param.shape):
                raise ConfigError(f"{folder}: {key} has shape {tuple(saved[key].shape)}, this "
                                  f"model {tuple(param.shape)}; use the same --lora-rank")
            mine[key] = saved[key]
        extra = sorted(set(saved) - set(mine))
        if extra:
            raise ConfigError(f"{folder} has {len(extra)} LoRA tensors this model lacks (e.g. "
                              f"{extra[0]}); use the same --set lora_targets it was trained with")
        with torch.no_grad():
            for name, param in zip(self.names, self.theta, strict=True):
                param.copy_(mine[_peft_key(name)].to(param.dtype))

    def set_alpha(self, log_tau=None, shift=None) -> None:
        """Set α (``[V]`` vectors, or their entries at the trained tokens); None: identity."""
        with torch.no_grad():
            for param, value in zip(self.alpha, (log_tau, shift), strict=False):
                if value is None:
                    param.zero_()
                    continue
                value = torch.as_tensor(value, dtype=param.dtype, device=param.device)
                if self.alpha_index is not None and value.numel() != param.numel():
                    value = value[self.alpha_index]
                param.copy_(value)

    def logits(self, theta, batch):
        """Float32 logits ``[P, V]`` at the batch's positions for LoRA values ``theta``."""
        from torch.func import functional_call

        return functional_call(self.head, dict(zip(self.names, theta, strict=True)),
                               (batch.input_ids, batch.attention_mask, batch.flat_positions),
                               strict=False)

    def full_alpha(self, alpha):
        """``(log_tau, shift)`` over the whole vocabulary (zeros outside the trained tokens)."""
        if self.alpha_index is None:
            return alpha[0], alpha[1]
        vocab = self.identity.vocab_size
        return tuple(torch.zeros(vocab, dtype=a.dtype, device=a.device)
                     .scatter(0, self.alpha_index, a) for a in alpha)

    def calibrate(self, z, alpha):
        """``z_α``: the calibration formula of calm_runtime with ``tau = exp(log_tau)`` (on
        centred logits when :attr:`center`)."""
        if len(alpha) == 2:
            log_tau, shift = self.full_alpha(alpha)
            return apply_calibration(z, torch.exp(log_tau), shift, center=self.center)
        if len(alpha) == 1:
            return apply_calibration(z, torch.exp(alpha[0]), center=self.center)
        return z

    def tau_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tau, shift)`` float32 ``[V]`` as the artifact stores them; ``tau`` is the same
        ``torch.exp(log_tau)`` the training computed, so the artifact reproduces it exactly."""
        vocab = self.identity.vocab_size
        with torch.no_grad():
            if len(self.alpha) == 2:
                log_tau, shift = self.full_alpha(self.alpha)
                return (torch.exp(log_tau).float().cpu().numpy(),
                        shift.float().cpu().numpy())
            tau = (torch.exp(self.alpha[0]).float().cpu().expand(vocab) if self.alpha
                   else torch.ones(vocab))
            return tau.numpy().copy(), np.zeros(vocab, np.float32)

    def objective(self, batches, loss: str, *, alpha_l2: float = 0.0, cft: dict | None = None):
        """An :data:`~.bilevel.Objective` summed over micro-``batches`` (their
        weights already divide by the rank's example count): ``ce``, ``neg_entropy`` (full
        vocabulary), ``neg_option_entropy`` (the K-option distribution) or ``cft`` (the
        calibration-aware fine-tuning loss; ``cft`` holds the keyword arguments of
        :func:`calm_training.methods.calm.cft.cft_loss` but the batch's). ``alpha_l2`` adds
        ``alpha_l2 · Σ α²`` over the trained α entries once (not per batch)."""

        def objective(theta, alpha, grad_theta, grad_alpha):
            wrt = [*(theta if grad_theta else ()), *(alpha if grad_alpha else ())]
            total = torch.zeros((), dtype=torch.float64)
            grads = None
            terms = [(batch, None) for batch in batches]
            if alpha_l2 and alpha:
                terms.append((None, alpha_l2))
            for batch, l2 in terms:
                with torch.set_grad_enabled(bool(wrt)):
                    if batch is None:
                        value = l2 * sum((a.double() ** 2).sum() for a in alpha)
                    else:
                        value = self.loss(theta, alpha, batch, loss, cft=cft)
                total += value.detach().double().cpu()
                if wrt and value.requires_grad:
                    parts = torch.autograd.grad(value, wrt, allow_unused=True)
                    parts = [torch.zeros_like(w) if p is None else p
                             for w, p in zip(wrt, parts, strict=True)]
                    grads = parts if grads is None else [
                        a + b for a, b in zip(grads, parts, strict=True)]
            if grads is None:
                grads = [torch.zeros_like(w) for w in wrt]
            n = len(theta) if grad_theta else 0
            return (total, grads[:n] if grad_theta else None,
                    grads[n:] if grad_alpha else None)

        return objective

    def loss(self, theta, alpha, batch, loss: str, *, cft: dict | None = None):
        """One batch's weighted loss (a scalar tensor). ``cft`` adds its two parts to
        :attr:`cft_parts` (reset by the caller)."""
        logp = self.calibrate(self.logits(theta, batch), alpha).log_softmax(-1)
        if loss == "cft":
            from calm_training.methods.calm.cft import cft_loss

            value, ce, l_cal = cft_loss(option_log_probs(logp, batch), answer_ce(logp, batch),
                                        batch.option_mask, weights=batch.example_weights,
                                        **cft)
            self.cft_parts["ce"] += float(ce.detach())
            self.cft_parts["l_cal"] += float(l_cal.detach())
            return value
        if loss == "ce":
            per = -logp.gather(1, batch.targets.clamp(min=0)[:, None]).squeeze(1)
        elif loss == "neg_entropy":
            per = (logp.exp() * logp).sum(-1)
        elif loss == "neg_option_entropy":
            option_logp = option_log_probs(logp, batch)
            neg_entropy = (option_logp.exp() * option_logp.masked_fill(
                ~batch.option_mask, 0.0)).sum(-1)
            return (neg_entropy * batch.example_weights).sum()
        elif loss == "daca_kl":
            return (masked_reference_kl(option_log_probs(logp, batch), batch.reference,
                                        batch.option_mask) * batch.example_weights).sum()
        else:
            raise ConfigError(f"unknown loss {loss!r}")
        return (per * batch.weights).sum()


def option_scores(logp, batch):
    """Option scores ``[E, k_max]`` (``-inf`` where an option is absent) from the
    log-probabilities ``[P, V]`` at an option-entropy batch's positions:
    ``s_k = Σ scale · log p(target)`` over the positions of option ``k``."""
    token_logp = logp.gather(1, batch.targets[:, None]).squeeze(1)
    flat = torch.zeros(batch.option_mask.numel(), dtype=logp.dtype, device=logp.device)
    flat = flat.index_add(0, batch.slots, token_logp * batch.scales.to(logp.dtype))
    return flat.view(batch.option_mask.shape).masked_fill(~batch.option_mask, float("-inf"))


def answer_ce(logp, batch):
    """Per-example cross-entropy ``[E]`` on the answer's tokens (their mean) of a labeled
    option batch: the positions of option ``labels[e]``."""
    k_max = batch.option_mask.shape[1]
    example, option = batch.slots // k_max, batch.slots % k_max
    on_answer = (option == batch.labels[example]).to(logp.dtype)
    token_logp = logp.gather(1, batch.targets[:, None]).squeeze(1)
    size = batch.option_mask.shape[0]
    total = torch.zeros(size, dtype=logp.dtype, device=logp.device)
    total = total.index_add(0, example, -token_logp * on_answer)
    count = torch.zeros_like(total).index_add(0, example, on_answer)
    return total / count.clamp(min=1.0)


def masked_reference_kl(option_logp, reference, option_mask):
    """DACA's agreement-masked KL per example ``[E]`` (docs/methods.md §3, §4):
    ``KL(p_ref ‖ p)`` where the reference's top option is the model's, 0 elsewhere (the mask
    carries no gradient)."""
    present = option_mask & (reference > 0)
    log_ref = torch.log(reference.clamp(min=1e-30))
    kl = (reference * (log_ref - option_logp)).masked_fill(~present, 0.0).sum(-1)
    ref_top = reference.masked_fill(~option_mask, -1.0).argmax(-1)
    agree = ref_top == option_logp.detach().argmax(-1)
    return kl * agree.to(kl.dtype)


def option_log_probs(logp, batch):
    """``log softmax`` over each example's option scores, ``[E, k_max]``."""
    return option_scores(logp, batch).log_softmax(-1)


def stack_option_rows(rows, fill: float):
    """Per-question option rows of any lengths (each batch pads to its own ``k_max``) as
    one ``[N, K_max]`` array, ``fill`` where a question has fewer options: ``-inf`` for
    log-probabilities, ``0`` for probabilities."""
    import numpy as np

    rows = [np.asarray(r, dtype=np.float64) for r in rows]
    out = np.full((len(rows), max((r.size for r in rows), default=0)), fill)
    for i, row in enumerate(rows):
        out[i, :row.size] = row
    return out


def _peft_key(name: str) -> str:
    """The key peft's ``adapter_model.safetensors`` uses for a trainable parameter name."""
    key = name.removeprefix("lm.").replace(".default.weight", ".weight")
    return key if key.startswith("base_model.") else "base_model.model." + key


class Ranks:
    """Rank, world size, the mean-over-ranks reduction and rank 0's word (identity in one
    process)."""

    def __init__(self, device) -> None:
        import torch.distributed as dist

        self.dist, self.owned, self.device = dist, False, torch.device(device)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo")
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

    def rank0s(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank: a decision that gates a collective (a barrier)
        must be one decision, not each rank's own look at a file another rank may be
        writing."""
        if self.world == 1:
            return bool(flag)
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        self.dist.broadcast(value, src=0)
        return bool(value.item())

    def close(self) -> None:
        if self.owned:
            self.dist.destroy_process_group()


def pick_device(config):
    if config.device:
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
