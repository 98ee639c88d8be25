"""Parity checks: unfused reference -> fused torch -> exported engine.

The reference is the unfused model (base + LoRA, not merged) with the calibration applied
to its logits in torch by :meth:`CalibrationAdapter.calibrate` (the formula module). It
generates greedily with its KV cache; every candidate then replays the reference's tokens
(teacher forcing, so all steps stay comparable) and must give the same logits within the
tolerance and the same greedy choice at every step. A differing choice is accepted only
when the reference's own margin between the two tokens is within the tolerance (a tie
that float rounding may break either way); such ties are counted in the report.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_runtime.data.prompts import (
    DEFAULT_P_TRUE_TEMPLATE,
    cloze_context,
    letter_prompt,
    p_true_template,
)
from calm_runtime.errors import ExportValidationError

__all__ = [
    "Case",
    "Rollout",
    "Comparison",
    "default_prompts",
    "build_cases",
    "rollout",
    "run_cases_together",
    "compare",
    "torch_reference_runner",
    "torch_decoder_runner",
    "onnx_runner",
]

logger = logging.getLogger(__name__)

#: (input_ids, attention_mask, position_ids, state) -> (logits [B, S, V] float32, state)
Runner = Callable[[np.ndarray, np.ndarray, np.ndarray, object], tuple[np.ndarray, object]]


def default_prompts(template: str | dict = DEFAULT_P_TRUE_TEMPLATE) -> list[str]:
    """Three short prompts in the formats the runtime scores (P(True), letters, cloze)."""
    return [
        p_true_template(template).render("What is the capital of France?", "Paris"),
        letter_prompt("Which planet is known as the red planet?",
                      ["Venus", "Mars", "Jupiter", "Saturn"]),
        cloze_context("Who wrote Hamlet?"),
    ]


@dataclass(frozen=True)
class Case:
    """One validation batch: left-padded prompt ids and their attention mask."""

    name: str
    input_ids: np.ndarray  # [B, S] int64
    attention_mask: np.ndarray  # [B, S] int64, zeros on the left padding


def build_cases(tokenizer, prompts: Sequence[str], pad_id: int,
                max_tokens: int | None = None) -> list[Case]:
    """Each prompt alone (batch 1), and the last two together (batch 2, left padding); a
    prompt longer than ``max_tokens`` keeps its first ``max_tokens`` tokens."""
    encoded = [list(tokenizer(text, add_special_tokens=True)["input_ids"])[:max_tokens]
               for text in prompts]
    cases = [_case(f"batch1[{i}]", [ids], pad_id) for i, ids in enumerate(encoded)]
    pair = sorted(encoded[-2:], key=len, reverse=True)
    if len(pair[0]) == len(pair[1]):
        pair[1] = pair[1][1:]  # make sure the batch-2 case really has left padding
    cases.append(_case("batch2", pair, pad_id))
    return cases


def _case(name: str, sequences: list[list[int]], pad_id: int) -> Case:
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = seq
        mask[row, length - len(seq):] = 1
    return Case(name, ids, mask)


@dataclass
class Rollout:
    """Logits of one case: every prompt position, then the ``N`` greedy choices."""

    prefill: np.ndarray  # [B, S, V]
    next_logits: np.ndarray  # [B, N, V]; next_logits[:, n] chose tokens[:, n]
    tokens: np.ndarray  # [B, N] int64


def rollout(run: Runner, case: Case, steps: int, forced: np.ndarray | None = None) -> Rollout:
    """Prefill, then ``steps - 1`` single-token KV-cache steps (greedy, or ``forced``)."""
    mask = case.attention_mask
    positions = np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int64)
    logits, state = run(case.input_ids, mask, positions, None)
    prefill = logits
    nexts, tokens = [logits[:, -1]], [logits[:, -1].argmax(-1)]
    for step in range(1, steps):
        fed = (forced[:, step - 1] if forced is not None else tokens[-1]).astype(np.int64)
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
        positions = positions[:, -1:] + 1
        logits, state = run(fed[:, None], mask, positions, state)
        nexts.append(logits[:, -1])
        tokens.append(logits[:, -1].argmax(-1))
    return Rollout(prefill, np.stack(nexts, 1), np.stack(tokens, 1).astype(np.int64))


@dataclass
class Comparison:
    """How far a candidate's rollout is from the reference's, over one or more cases."""

    max_abs_diff: float = 0.0
    where: str = ""
    greedy_total: int = 0
    greedy_mismatches: int = 0
    greedy_ties: int = 0
    first_mismatch: str = ""

    def merge(self, other: Comparison) -> Comparison:
        worse = other.max_abs_diff > self.max_abs_diff or (
            other.max_abs_diff != other.max_abs_diff)  # NaN counts as worse
        return Comparison(
            max_abs_diff=other.max_abs_diff if worse else self.max_abs_diff,
            where=other.where if worse else self.where,
            greedy_total=self.greedy_total + other.greedy_total,
            greedy_mismatches=self.greedy_mismatches + other.greedy_mismatches,
            greedy_ties=self.greedy_ties + other.greedy_ties,
            first_mismatch=self.first_mismatch or other.first_mismatch)


def compare(name: str, case: Case, ref: Rollout, got: Rollout, tolerance: float) -> Comparison:
    """Max |logit difference| over real (unpadded) positions and the greedy agreement."""
    real = case.attention_mask.astype(bool)
    prefill = np.abs(got.prefill - ref.prefill)[real]
    steps = np.abs(got.next_logits - ref.next_logits)
    worst_prefill = float(np.nan_to_num(prefill.max(), nan=np.inf))
    worst_steps = float(np.nan_to_num(steps.max(), nan=np.inf))
    if worst_prefill >= worst_steps:
        result = Comparison(worst_prefill, f"{name} prompt")
    else:
        flat = int(np.nan_to_num(steps.max(-1), nan=np.inf).argmax())
        row, step = np.unravel_index(flat, steps.shape[:2])
        result = Comparison(worst_steps, f"{name} row {row} step {step}")
    result.greedy_total = ref.tokens.size
    for row, step in zip(*np.nonzero(got.tokens != ref.tokens), strict=True):
        expected, chosen = ref.tokens[row, step], got.tokens[row, step]
        margin = float(ref.next_logits[row, step, expected] - ref.next_logits[row, step, chosen])
        if margin <= tolerance:
            result.greedy_ties += 1
            continue
        result.greedy_mismatches += 1
        if not result.first_mismatch:
            result.first_mismatch = (f"{name} row {row} step {step}: token {chosen} instead of "
                                     f"{expected} (reference margin {margin:.3g})")
    return result


def check(what: str, comparison: Comparison, tolerance: float) -> None:
    """Raise :class:`ExportValidationError` (one line, with the numbers) unless within bounds."""
    diff_ok = comparison.max_abs_diff <= tolerance
    if diff_ok and comparison.greedy_mismatches == 0:
        return
    matched = comparison.greedy_total - comparison.greedy_mismatches
    detail = (f"max |logit diff| {comparison.max_abs_diff:.3g} at {comparison.where}, "
              f"tolerance {tolerance:.3g}; greedy tokens {matched}/{comparison.greedy_total} "
              "match")
    if comparison.first_mismatch:
        detail += f" (first differs at {comparison.first_mismatch})"
    raise ExportValidationError(f"{what} does not match the reference: {detail}; no engine was "
                                "written")


# ---------------------------------------------------------------------- runners
#: rows of a half-precision Linear's weight upcast at a time by :func:`float32_compute`
UPCAST_ROWS = 8192


@contextlib.contextmanager
def float32_compute(model):
    """Run ``model`` (float16 or bfloat16 weights) in float32 meanwhile, without a float32
    copy of it: each Linear computes its output from its weight upcast ``UPCAST_ROWS`` rows at
    a time, an Embedding's rows are upcast after the lookup (exact), and the other modules'
    own parameters (norms: a few numbers) are upcast while the context lasts. The reference's
    logits are then the float32 computation on the weights the engine is built from. A float32
    model is left as it is."""
    import torch
    from torch import nn

    if not any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        yield model
        return
    undo = []

    def linear_forward(module):
        def forward(hidden):
            hidden = hidden.float()
            weight, bias = module.weight, module.bias
            parts = [nn.functional.linear(
                hidden, weight[start:start + UPCAST_ROWS].float(),
                None if bias is None else bias[start:start + UPCAST_ROWS].float())
                for start in range(0, weight.shape[0], UPCAST_ROWS)]
            return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        return forward

    try:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.forward = linear_forward(module)
                undo.append(lambda m=module: m.__dict__.pop("forward", None))
            elif isinstance(module, nn.Embedding):
                handle = module.register_forward_hook(lambda _m, _a, out: out.float())
                undo.append(handle.remove)
            else:
                for name, param in list(module._parameters.items()):
                    if param is not None and param.dtype in (torch.float16, torch.bfloat16):
                        module._parameters[name] = nn.Parameter(param.detach().float(),
                                                                requires_grad=False)
                        undo.append(lambda m=module, n=name, p=param:
                                    m._parameters.__setitem__(n, p))
        yield model
    finally:
        for step in reversed(undo):
            step()


def torch_reference_runner(model, adapter) -> Runner:
    """The unfused model with its KV cache; calibration applied by the formula module
    (``adapter=None``: the model's own logits, for a checkpoint with the calibration in it)."""
    import torch
    from transformers import DynamicCache

    def run(input_ids, attention_mask, position_ids, state):
        cache = DynamicCache() if state is None else state
        with torch.inference_mode():
            out = model(input_ids=torch.from_numpy(input_ids),
                        attention_mask=torch.from_numpy(attention_mask),
                        position_ids=torch.from_numpy(position_ids), cache=cache, use_cache=True)
            logits = out.logits.float()
            if adapter is not None:
                logits = adapter.calibrate(logits)
        return logits.numpy(), out.cache

    return run


def torch_decoder_runner(decoder, shape) -> Runner:
    """The fused model through the same wrapper that is exported (flat past tensors)."""
    import torch

    def run(input_ids, attention_mask, position_ids, state):
        if state is None:
            state = tuple(torch.zeros(input_ids.shape[0], shape.num_kv_heads, 0, shape.head_dim)
                          for _ in range(2 * shape.num_layers))
        with torch.inference_mode():
            logits, *present = decoder(torch.from_numpy(input_ids),
                                       torch.from_numpy(attention_mask),
                                       torch.from_numpy(position_ids), state)
        return logits.numpy(), tuple(present)

    return run


#: the validation's session does not prepack its GEMM weights: ONNX Runtime then keeps them
#: where it maps them from the external-data file and packs each block as it multiplies.
#: A packed copy is what serving keeps for speed; for the validation's few prompts it is a
#: second copy of every weight still needed unpacked (a tied head is also the embedding's
#: Gather: measured 0.95 GB of a 1.2B model's 4.9 GB) and most of the session's start.
VALIDATION_CONFIG = {"session.disable_prepacking": "1"}


def onnx_runner(path: Path, shape, providers=None) -> tuple[Runner, str]:
    """``path`` run as ``calm serve`` runs it: calm_runtime's ONNX Runtime backend (full
    graph optimisation, IO binding; a packed graph through its in-place cache) on
    ``providers`` (default the CPU; calm-export's ``--device cuda``: CUDA), its weights not
    prepacked (:data:`VALIDATION_CONFIG`); the KV cache takes the graph's dtype (float16 for
    fp16 graphs)."""
    import onnxruntime as ort

    from calm_runtime.inference.backends import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(_GraphFacts(Path(path), shape), providers=providers,
                                 config_entries=VALIDATION_CONFIG)
    used = backend.session.get_providers()[0] if hasattr(backend, "session") else (
        "CPUExecutionProvider")

    def run(input_ids, attention_mask, position_ids, state):
        return backend.run(input_ids, attention_mask, position_ids, state)

    return run, (f"onnxruntime {ort.__version__} {used} (calm_runtime's backend, weights not "
                 "prepacked)")


class _GraphFacts:
    """What :class:`~calm_runtime.inference.backends.OnnxRuntimeBackend` reads from a
    manifest, for a graph that has none yet (the I/O names are read from the graph
    itself)."""

    def __init__(self, path: Path, shape) -> None:
        import onnx

        from calm_runtime.formats.engine import engine_io_names

        graph = onnx.load(str(path), load_external_data=False).graph
        positions = any(i.name == "position_ids" for i in graph.input)
        inputs, outputs = engine_io_names(shape.num_layers, position_ids=positions)
        self._path = path
        self.num_layers = shape.num_layers
        self.vocab_size = shape.vocab_size
        self.io = {"inputs": inputs, "outputs": outputs}
        self.packed = not positions
        self.model = {"num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                      "vocab_size": shape.vocab_size}

    def path(self, name: str) -> Path:
        return self._path.parent / name if name != "model.onnx" else self._path


def run_cases(run: Runner, cases: Sequence[Case], steps: int,
              references: Sequence[Rollout] | None = None, progress=None) -> list[Rollout]:
    """Roll every case out (greedy, or replaying the references' tokens)."""
    results = []
    for index, case in enumerate(cases):
        forced = None if references is None else references[index].tokens
        results.append(rollout(run, case, steps, forced))
        if progress is not None:
            progress.update(1)
    return results


def run_cases_together(run: Runner, cases: Sequence[Case], steps: int) -> list[Rollout]:
    """Every case's greedy rollout from one batch of all their rows (left-padded together):
    what :func:`run_cases` gives, in one pass per step instead of one per case and step (the
    reference of a large model reads its weights a quarter as often). A row's real positions
    keep their positions, so only the padding's logits differ, which no comparison reads."""
    rows = [case.input_ids[r][case.attention_mask[r].astype(bool)].tolist()
            for case in cases for r in range(case.input_ids.shape[0])]
    together = rollout(run, _case("together", rows, 0), steps)
    results, start = [], 0
    for case in cases:
        batch, width = case.input_ids.shape
        picked = slice(start, start + batch)
        # copies: the batch of every row (each padded to the longest) is not kept alive
        results.append(Rollout(prefill=together.prefill[picked, -width:].copy(),
                               next_logits=together.next_logits[picked].copy(),
                               tokens=together.tokens[picked].copy()))
        start += batch
    return results


def compare_all(cases: Sequence[Case], references: Sequence[Rollout], got: Sequence[Rollout],
                tolerance: float) -> tuple[Comparison, Comparison]:
    """(batch-1 cases, batch-2 cases) comparisons."""
    single, double = Comparison(), Comparison()
    for case, ref, cand in zip(cases, references, got, strict=True):
        result = compare(case.name, case, ref, cand, tolerance)
        if case.input_ids.shape[0] == 1:
            single = single.merge(result)
        else:
            double = double.merge(result)
    return single, double


def passed_report(single: Comparison, double: Comparison, tolerance: float, scale: float,
                  steps: int, cases: Sequence[Case], runtime: str, reference: str,
                  **extra) -> dict:
    """The manifest's ``validation`` of a graph or checkpoint that passed: the single-prompt
    and the padded-batch comparisons, the tolerance and what ran against what."""
    overall = single.merge(double)
    return {"passed": True, "max_abs_diff": overall.max_abs_diff, "worst_at": overall.where,
            "batch1_max_abs_diff": single.max_abs_diff,
            "batch2_max_abs_diff": double.max_abs_diff, "tolerance": tolerance,
            "reference_scale": scale, "greedy_steps": steps, "greedy_match": True,
            "greedy_ties": single.greedy_ties + double.greedy_ties,
            "cases": [c.name for c in cases], "runtime": runtime, "reference": reference,
            **extra}


def reference_scale(references: Sequence[Rollout]) -> float:
    """The largest |calibrated logit| the reference produced (sets the relative tolerance)."""
    return max(max(float(np.abs(r.prefill).max()), float(np.abs(r.next_logits).max()))
               for r in references)
