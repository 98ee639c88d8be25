"""``CalibratedLM``: load an engine, generate with calibrated confidences, score answers.

    lm = CalibratedLM.load("engine/", backend="onnxruntime")
    out = lm.generate("Question: ...", max_new_tokens=32)
    out.text, out.tokens[0].confidence, out.sequence_confidence
    lm.choose("2 + 2 =", ["3", "4", "5"])          # cloze mode, option probabilities
    lm.p_true(question, answer)

The engine's graph already outputs calibrated logits (the head is fused), so every
probability here is calibrated; only cloze mode's ``answer_temperature`` acts on option
scores (docs/methods.md §2). Prompts and token ids are those of training
(:mod:`calm_runtime.data.prompts`, the manifest's ``option_tokens`` and ``add_bos``).

Thread safety: a ``CalibratedLM`` is immutable after :meth:`load`; every call keeps its
state (KV cache, decoders, random generators) local, and the backends' ``run`` is
thread-safe, so one instance serves many threads.

Context length: every input a call builds (a prompt, a question with each of its options,
a P(True) prompt) is tokenised and checked against the model's context
(``max_position_embeddings``) before anything is batched or run; one that does not fit
raises a one-line :class:`~calm_runtime.errors.ConfigError` naming the input, its token
count and the limit. Text must be valid Unicode (a lone UTF-16 surrogate is refused).

Memory: ``max_prefill_tokens`` (default 4,096; ``calm serve --max-prefill-tokens``) bounds
every forward pass over many positions, for generation and scoring alike: a pass takes at
most that many tokens (rows x padded length) and holds at most 64 KiB of attention scores
and logits per token of it (256 MiB at the default). Larger batches are cut into groups of
rows, and longer prompts into pieces of positions on top of their KV cache
(:class:`~calm_runtime.inference.generation.PrefillBudget`); a prompt that cannot fit
even alone (on a backend that cannot prefill in pieces: TensorRT) is refused before
anything runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace

import numpy as np

from calm_runtime.errors import ArtifactError, ConfigError
from calm_runtime.formats.artifact import outputs_in_mode
from calm_runtime.formats.engine import EngineManifest
from calm_runtime.inference import scoring_passes
from calm_runtime.inference._inputs import check_text, input_label, non_negative_int, positive_int
from calm_runtime.inference._judging import Judging, recorded_cloze_variant
from calm_runtime.inference.backends import Backend, create_backend
from calm_runtime.inference.generation import (
    DEFAULT_MAX_PREFILL_TOKENS,
    DecodeSettings,
    GenerationRun,
    PrefillBudget,
    released,
)
from calm_runtime.inference.results import Alternative, Generation, PromptToken, Token
from calm_runtime.inference.sampling import DecodeOptions, SamplingParams, raw_log_softmax
from calm_runtime.inference.tokenization import EngineTokenizer
from calm_runtime.modes import CHOICE_MODES, CLOZE_VARIANTS, DEFAULT_CLOZE_VARIANT

__all__ = ["CalibratedLM", "CLOZE_VARIANTS", "recorded_cloze_variant"]

logger = logging.getLogger(__name__)

#: a token covers at most this many times the longest token string of the vocabulary
CHARS_PER_TOKEN_MARGIN = 4


def recorded_threshold(manifest: EngineManifest) -> float | None:
    """The abstention threshold ``calm fit threshold`` chose, if the engine records one."""
    abstention = (manifest.export or {}).get("abstention")
    if isinstance(abstention, Mapping):
        value = abstention.get("threshold")
        if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1:
            return float(value)
    return None


def recorded_choice_mode(manifest: EngineManifest) -> str | None:
    """The scoring mode (``cloze`` or ``letter``) whose confidences the engine's calibration
    was fitted on: ``export.choice_mode`` (written by calm-export), else the mode of the
    recorded abstention threshold; ``None`` when the manifest says neither."""
    export = manifest.export or {}
    value = export.get("choice_mode")
    abstention = export.get("abstention")
    if value is None and isinstance(abstention, Mapping):
        value = abstention.get("mode")
    return value if value in CHOICE_MODES else None


class CalibratedLM(Judging):
    """A calibrated engine ready to generate and score; build it with :meth:`load`."""

    def __init__(self, manifest: EngineManifest, backend: Backend,
                 tokenizer: EngineTokenizer, *,
                 max_prefill_tokens: int | None = DEFAULT_MAX_PREFILL_TOKENS) -> None:
        self.manifest = manifest
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_context: int = manifest.model["max_position_embeddings"]
        if max_prefill_tokens is not None:
            max_prefill_tokens = positive_int(max_prefill_tokens, "max_prefill_tokens")
        #: the most tokens one pass over many positions takes (``None``: unbounded); see the
        #: module doc. The budget is the backend's (``backend.prefill_budget``), which the
        #: scoring passes read too
        self.max_prefill_tokens: int | None = max_prefill_tokens
        self.prefill_budget: PrefillBudget | None = (
            None if max_prefill_tokens is None
            else PrefillBudget.for_backend(backend, manifest, max_prefill_tokens))
        backend.prefill_budget = self.prefill_budget
        # text that cannot fit the context by its length alone is refused before it is
        # tokenised: no allocation is sized by the input (a token covers at most the longest
        # token string of the vocabulary; 4x margin for normalisers that compose characters)
        tokenizer.max_chars = (self.max_context * tokenizer.longest_token_chars()
                               * CHARS_PER_TOKEN_MARGIN)
        recorded = recorded_cloze_variant(manifest)
        #: the cloze variant the engine's answer temperature was fitted on, if it records one
        self.recorded_variant: str | None = recorded
        self.default_variant: str = recorded or DEFAULT_CLOZE_VARIANT
        #: answers with a confidence below this are marked abstained (calm fit threshold,
        #: recorded in the engine by calm-export); None: never
        self.abstain_below: float | None = recorded_threshold(manifest)
        #: the mode a constrained choice is scored in when the request does not say (the
        #: server's ``choice_mode`` default): the one the calibration was fitted on, else cloze
        self.choice_mode: str = recorded_choice_mode(manifest) or "cloze"
        if recorded is None and manifest.answer_temperature is not None:
            logger.warning("%s has an answer_temperature but does not record the cloze variant "
                           "it was fitted on; cloze scores use %r unless variant= says "
                           "otherwise", manifest.root, DEFAULT_CLOZE_VARIANT)

    @classmethod
    def load(cls, engine_dir: str | os.PathLike, backend: str = "onnxruntime", *,
             providers=None, threads: int | None = None, verify_hashes: bool = True,
             max_prefill_tokens: int | None = DEFAULT_MAX_PREFILL_TOKENS,
             **backend_options) -> CalibratedLM:
        """Load and check an engine directory and start ``backend`` on it.

        ``providers`` and ``threads`` go to the ONNX Runtime backend (``threads`` also to
        torch); other keyword arguments go to the backend class (e.g. ``model=``,
        ``adapter=``, ``device=`` for :class:`~calm_runtime.inference.backends.TorchBackend`).
        ``verify_hashes=False`` skips hashing the files (faster start; files are still
        checked to exist). ``max_prefill_tokens`` bounds the memory of every pass over many
        positions (the module doc; ``None``: unbounded).
        """
        manifest = EngineManifest.load(engine_dir, verify_hashes=verify_hashes)
        tokenizer = EngineTokenizer(manifest)
        size = tokenizer.vocab_size
        if size > manifest.vocab_size:
            raise ArtifactError(f"{manifest.root}: the tokenizer has {size} tokens but the "
                                f"manifest's model.vocab_size is {manifest.vocab_size}; "
                                "re-export the engine")
        options = dict(backend_options)
        if backend == "onnxruntime":
            options.update(providers=providers, threads=threads)
        elif providers is not None:
            raise ConfigError(f"providers only applies to backend='onnxruntime', not {backend!r}")
        elif threads is not None and backend == "torch":
            options["threads"] = threads
        if max_prefill_tokens is not None:
            positive_int(max_prefill_tokens, "max_prefill_tokens")  # before the session starts
        runner = create_backend(backend, manifest, **options)
        logger.info("loaded %s on %s", manifest.root, runner.description)
        return cls(manifest, runner, tokenizer, max_prefill_tokens=max_prefill_tokens)

    @property
    def answer_temperature(self) -> float:
        """Cloze mode's answer-level temperature (1.0 when the engine records none)."""
        value = self.manifest.answer_temperature
        return 1.0 if value is None else float(value)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token of one sequence takes (keys and values, all layers)."""
        m = self.manifest.model
        width = 2 if m["dtype"] == "float16" else 4
        return 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * width

    @property
    def calibrated_outputs(self) -> dict:
        """Which outputs this engine calibrates and by which fit (``None``: the model's own):
        ``{"token_logprobs", "option_probabilities", "p_true"}``."""
        return self.manifest.calibrated_outputs

    def calibrated_outputs_in(self, mode: str) -> dict:
        """:attr:`calibrated_outputs` as a choice in ``mode`` applies them: a letter-mode
        choice reads the option letters' token log-probabilities, so its option probabilities
        are calibrated only by a token-level calibration (a cloze answer temperature is not
        applied there)."""
        return outputs_in_mode(self.manifest.calibrated_outputs, mode)

    @property
    def raw_logit_scale(self) -> float:
        """``s`` with ``log_softmax(s · z_cal) == log_softmax(z)``: how the model's raw
        (uncalibrated) log-probabilities are recovered from the calibrated logits.

        The engine's logits are ``z_cal = (z / tau + shift) / T`` (fused). When ``tau`` and
        ``shift`` are one value each over the vocabulary (an uncalibrated engine, or a
        temperature such as DACA's), ``z = tau · (T · z_cal − shift)`` and the constant
        shift drops out of the softmax, so ``s = tau · T``. Per-token ``tau`` or ``shift``
        (CALM) cannot be undone from the engine's output: :class:`ConfigError`.
        """
        c = self.manifest.calibration
        if c["tau_min"] != c["tau_max"] or c["shift_min"] != c["shift_max"]:
            raise ConfigError(
                f"this engine fuses per-token calibration ({c['adapter_kind']}: tau in "
                f"[{c['tau_min']:g}, {c['tau_max']:g}], shift in [{c['shift_min']:g}, "
                f"{c['shift_max']:g}]); its raw log-probabilities cannot be recovered from its "
                "logits; serve an engine exported without the adapter for raw log-probabilities")
        return float(c["tau_min"]) * float(c["temperature"])

    def close(self) -> None:
        self.backend.close()

    def __repr__(self) -> str:
        return f"CalibratedLM({self.manifest.root}, {self.backend.description})"

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str, *, chat: bool | None = False,
                      label: str = "the prompt") -> list[int]:
        """Token ids of a prompt: the chat template (``chat``) or BOS per the manifest.

        Raises :class:`ConfigError` for an empty prompt, invalid Unicode, or one longer
        than the model's context; ``label`` names the prompt in that message (e.g.
        ``"prompt[2]"`` of a batch).
        """
        if not isinstance(prompt, str):
            raise ConfigError(f"{label} must be a string, got {type(prompt).__name__}")
        if not prompt:
            which = "" if label == "the prompt" else f" ({label})"
            raise ConfigError(f"the prompt is empty{which}; pass some text to generate from or "
                              "score")
        check_text(prompt, label)
        self._check_chars(prompt, label, "shorten the prompt")
        if self.tokenizer.use_chat(chat):
            ids = self.tokenizer.encode_chat(prompt)
        else:
            ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError(f"{label} {prompt[:40]!r} encodes to no tokens; pass some text")
        if len(ids) > self.max_context:
            raise ConfigError(f"{label} is {len(ids)} tokens but the model's context is "
                              f"{self.max_context}; shorten the prompt")
        return ids

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str | Sequence[str], max_new_tokens: int = 32, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, stop: str | Sequence[str] = (),
                 top_alternatives: int = 0, chat: bool | None = False,
                 batch_size: int = 8, raw_logprobs: bool = False,
                 ignore_eos: bool = False) -> Generation | list[Generation]:
        """Generate from one prompt (returns a :class:`Generation`) or a list (a list).

        Greedy when ``temperature == 0`` (the default), else sampled with ``top_k``,
        ``top_p`` and ``seed`` (see :mod:`calm_runtime.inference.sampling`); the reported
        confidences are calibrated probabilities whatever the sampling settings. Stops at
        an end-of-sequence token, a ``stop`` string (cut from the text) or
        ``max_new_tokens`` (or the model's context). ``top_alternatives=k`` adds the k
        most probable tokens of every step. ``chat=True`` wraps the prompt as a user
        message in the engine's chat template (``None``: when there is one).
        ``raw_logprobs=True`` adds each token's (and alternative's) raw, uncalibrated
        log-probability (see :attr:`raw_logit_scale`; engines with per-token calibration
        refuse it). ``ignore_eos=True`` decodes past end-of-sequence tokens (a fixed number
        of tokens, as benchmarks need).
        """
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if not prompts:
            raise ConfigError("no prompts given; pass a string or a non-empty list of strings")
        encoded = [self.encode_prompt(p, chat=chat,
                                      label=input_label("prompt", i, len(prompts)))
                   for i, p in enumerate(prompts)]
        settings = self._settings(encoded, max_new_tokens, temperature, top_k, top_p, seed,
                                  stop, top_alternatives, raw_logprobs, ignore_eos)
        size = positive_int(batch_size, "batch_size")
        size = min(size, self.backend.max_batch or size)
        results: list[Generation] = []
        for start in range(0, len(encoded), size):
            part = slice(start, start + size)
            run = GenerationRun(self.backend, self.tokenizer, encoded[part],
                                _rows(settings, part, start))
            for _ in run:
                pass
            results.extend(run.results)
        return results[0] if single else results

    def generation_run(self, encoded: Sequence[Sequence[int]],
                       max_new_tokens: int | Sequence[int], *,
                       cancelled: Callable[[int], bool] | None = None,
                       decode: DecodeOptions | None = None, **options) -> GenerationRun:
        """One batched decode over already-encoded prompts, for callers that schedule rows
        themselves (e.g. ``calm serve``'s step scheduler, which takes its rows' specs,
        :meth:`GenerationRun.row_specs`).

        ``max_new_tokens`` is one limit or one per prompt; ``options`` are :meth:`generate`'s
        sampling options. Iterating the run yields ``(row, Token)`` as tokens are chosen;
        its ``results`` hold one :class:`Generation` per prompt at the end, equal to
        ``generate``'s for the same prompts and settings. At most ``backend.max_batch``
        prompts, each non-empty, of valid token ids, and shorter than the model's context.
        ``cancelled(row)`` is asked before every decode step for each unfinished row; a row
        it answers ``True`` for stops there (``finish_reason="cancelled"``) and frees its
        place in the batch, the other rows decode on unchanged. ``decode`` gives the
        options as one :class:`~calm_runtime.inference.sampling.DecodeOptions` instead of
        keywords.
        """
        if decode is not None:
            if options:
                raise ConfigError(f"pass decode options either as decode= or as keywords, not "
                                  f"both (got {', '.join(sorted(options))})")
            options = decode.as_kwargs()
        encoded = [list(ids) for ids in encoded]
        if not encoded:
            raise ConfigError("no prompts given; pass at least one encoded prompt")
        vocab = self.manifest.vocab_size
        for i, ids in enumerate(encoded):
            label = input_label("prompt", i, len(encoded))
            if not ids:
                raise ConfigError(f"{label} has no token ids; pass at least one token")
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                raise ConfigError(f"{label} has token id {low if low < 0 else high}, outside "
                                  f"this model's vocabulary of {vocab}; encode it with "
                                  "encode_prompt")
        if self.backend.max_batch and len(encoded) > self.backend.max_batch:
            raise ConfigError(f"{len(encoded)} prompts exceed this backend's batch limit of "
                              f"{self.backend.max_batch}; split them")
        limits = ([max_new_tokens] * len(encoded) if isinstance(max_new_tokens, (int, np.integer))
                  else list(max_new_tokens))
        if len(limits) != len(encoded):
            raise ConfigError(f"{len(limits)} max_new_tokens for {len(encoded)} prompts; pass one "
                              "per prompt")
        settings = self._settings(encoded, max(positive_int(n, "max_new_tokens") for n in limits),
                                  **_sampling_options(dict(options)))
        capped = tuple(min(n, cap) for n, cap in zip(limits, settings.max_new_tokens, strict=True))
        return GenerationRun(self.backend, self.tokenizer, encoded,
                             replace(settings, max_new_tokens=capped), cancelled=cancelled)

    def stream(self, prompt: str, max_new_tokens: int = 32, **options) -> Iterator[Token]:
        """An iterator over the tokens of ``generate(prompt, ...)`` as they are chosen.

        Takes the same options; the tokens equal ``generate``'s. Bad arguments raise here,
        not at the first ``next()``.
        """
        if not isinstance(prompt, str):
            raise ConfigError("stream takes one prompt string; use generate for a batch")
        chat = options.pop("chat", False)
        run = self.generation_run([self.encode_prompt(prompt, chat=chat)], max_new_tokens,
                                  **options)
        return (token for _, token in run)  # arguments are checked above, before iterating

    def _settings(self, encoded, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0,
                  seed=None, stop=(), top_alternatives=0,
                  raw_logprobs=False, ignore_eos=False) -> DecodeSettings:
        max_new = positive_int(max_new_tokens, "max_new_tokens")
        top_n = top_alternatives
        if isinstance(top_n, bool) or not isinstance(top_n, (int, np.integer)) or top_n < 0:
            raise ConfigError(f"top_alternatives must be an integer >= 0, got {top_n!r}")
        stops = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ConfigError(f"stop strings must be non-empty strings, got {stops!r}")
        limits = []
        for i, ids in enumerate(encoded):
            room = self.max_context - len(ids)
            if room < 1:
                raise ConfigError(f"{input_label('prompt', i, len(encoded))} is {len(ids)} tokens "
                                  f"and fills the model's context of {self.max_context}; shorten "
                                  "it to leave room to generate")
            self.check_prefill(len(ids), input_label("prompt", i, len(encoded)))
            limits.append(min(max_new, room))
        return DecodeSettings(max_new_tokens=tuple(limits),
                              sampling=SamplingParams(temperature=temperature, top_k=top_k,
                                                      top_p=top_p, seed=seed),
                              stop=stops, top_alternatives=int(top_n),
                              eos_ids=(frozenset() if ignore_eos
                                       else frozenset(self.tokenizer.eos_token_ids)),
                              raw_scale=self.raw_logit_scale if raw_logprobs else None)

    def check_prefill(self, n_tokens: int, label: str = "the prompt",
                      flag: str = "max_prefill_tokens") -> None:
        """Refuse (:class:`ConfigError`, naming ``flag``) a prompt of ``n_tokens`` that cannot
        be prefilled even alone within ``max_prefill_tokens`` (see the module doc)."""
        if self.prefill_budget is not None:
            self.prefill_budget.check(n_tokens, label, flag)

    # ------------------------------------------------------------------ multiple choice
    def prompt_logprobs(self, prompt: str, *, top: int = 0, raw_logprobs: bool = False,
                        should_stop=None) -> list[PromptToken]:
        """Every prompt token with its calibrated log-probability given the tokens before it
        (the first has none), its character offset in ``prompt`` and, with ``top``, the
        most probable tokens at its position: the prompt scoring of an ``echo`` request.

        The prompt is encoded as :meth:`generate` encodes it (BOS first when the engine's
        tokenizer adds one), in segments of positions whose logits fit
        :data:`~calm_runtime.inference.scoring_passes.SCORING_BUDGET_BYTES` (the KV cache
        carries over), with
        ``should_stop()`` checked between them. ``raw_logprobs=True`` adds the raw,
        uncalibrated log-probabilities (see :attr:`raw_logit_scale`).
        """
        # the call's cache is gone at the end, however it ends: the backend gives memory back
        return released(self.backend, self._prompt_logprobs, prompt, top, raw_logprobs,
                        should_stop)

    def _prompt_logprobs(self, prompt, top, raw_logprobs, should_stop) -> list[PromptToken]:
        check_text(prompt, "the prompt")
        if not prompt:
            raise ConfigError("the prompt is empty; pass the text to score")
        top = non_negative_int(top, "top")
        scale = self.raw_logit_scale if raw_logprobs else None
        self._check_chars(prompt, "the prompt", "shorten the prompt")
        ids, spans = self.tokenizer.encode_with_offsets(prompt)
        offsets = [start for start, _ in spans]
        if self.tokenizer.add_bos:
            ids, offsets = [self.tokenizer.bos_token_id, *ids], [0, *offsets]
        self._check_length(len(ids), f"the prompt ({len(ids)} tokens)",
                           "shorten the prompt")
        segment = max(1, scoring_passes.SCORING_BUDGET_BYTES // (self.manifest.vocab_size * 8))
        if self.prefill_budget is not None:  # the attention scores of a segment, too
            fits = self.prefill_budget.span(1, len(ids) - 1, all_logits=True)
            if fits < 1:
                raise ConfigError(f"the prompt ({len(ids)} tokens) cannot be scored within "
                                  f"max_prefill_tokens {self.max_prefill_tokens}: one position "
                                  "over it needs more; shorten the prompt or raise it")
            segment = min(segment, fits)
        out = [PromptToken(ids[0], self._piece(prompt, spans, 0), offsets[0], None)]
        state, logits, done = None, None, 0
        for t in range(1, len(ids)):
            if t - 1 >= done:  # run the next segment of positions t-1 .. (the cache carries)
                if should_stop is not None and should_stop():
                    raise scoring_passes.ScoringStopped()
                end = min(len(ids) - 1, done + segment)
                batch = np.asarray([ids[done:end]], dtype=np.int64)
                logits, state = self.backend.run(
                    batch, np.ones((1, end), dtype=np.int64),
                    np.arange(done, end, dtype=np.int64)[None], state)
                first = done
                done = end
            row = logits[0, t - 1 - first].astype(np.float64)
            row = row - row.max()
            logp = row - np.log(np.exp(row).sum())
            raw = None if scale is None else raw_log_softmax(row, scale)
            alternatives = None
            if top:
                best = np.argpartition(-logp, min(top, logp.size - 1))[:top]
                best = best[np.argsort(-logp[best], kind="stable")]
                alternatives = tuple(Alternative(int(i), self.tokenizer.token_text(int(i)),
                                                 float(np.exp(logp[i])),
                                                 None if raw is None else float(raw[i]))
                                     for i in best)
            out.append(PromptToken(ids[t], self._piece(prompt, spans, t), offsets[t],
                                   float(logp[ids[t]]), alternatives,
                                   None if raw is None else float(raw[ids[t]])))
        return out

    def _piece(self, prompt: str, spans: Sequence[tuple[int, int]], t: int) -> str:
        """The prompt text of token ``t`` (``""`` for the BOS the engine adds)."""
        shift = 1 if self.tokenizer.add_bos else 0
        if t < shift:
            return ""
        start, end = spans[t - shift]
        return prompt[start:end]

    # ------------------------------------------------------------------ helpers
    def _prompt_ids(self, text: str, use_chat: bool, label: str, fix: str) -> list[int]:
        self._check_chars(text, label, fix)
        if use_chat:
            ids = self.tokenizer.encode_chat(text)
        else:
            ids = self.tokenizer.encode(text)
        self._check_length(len(ids), label, fix)
        return ids

    def _check_chars(self, text: str, label: str, fix: str) -> None:
        """Refuse, before tokenising, a text too long in characters for the context."""
        cap = self.tokenizer.max_chars
        if cap is not None and len(text) > cap:
            raise ConfigError(f"{label} is {len(text):,} characters, more than the model's "
                              f"{self.max_context}-token context can hold; {fix}")

    def _check_length(self, n: int, label: str, fix: str) -> None:
        if n > self.max_context:
            raise ConfigError(f"{label} is {n} tokens but the model's context is "
                              f"{self.max_context}; {fix}")


def _rows(settings: DecodeSettings, part: slice, start: int) -> DecodeSettings:
    """The settings of one slice of the batch: row ``start + i`` keeps its limit and generator."""
    return replace(settings, max_new_tokens=settings.max_new_tokens[part], row_offset=start)


def _sampling_options(options: dict) -> dict:
    allowed = {"temperature", "top_k", "top_p", "seed", "stop", "top_alternatives",
               "raw_logprobs", "ignore_eos"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(f"unknown generation option(s) {unknown}; use {sorted(allowed)}")
    return options
