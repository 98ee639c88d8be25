"""Judging answers with a loaded engine: multiple-choice option probabilities (cloze and
letter mode, constrained continuations) and P(True). A mixin of
:class:`calm_runtime.inference.lm.CalibratedLM`, which provides the manifest, tokenizer, backend and
the context checks (``_check_chars``, ``_check_length``, ``_prompt_ids``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from calm_runtime import modes
from calm_runtime.data.prompts import (
    cloze_context,
    cloze_continuation,
    cloze_option_scores,
    cloze_variant_for,
    letter_prompt,
    letter_tokens,
    option_char_count,
    option_letters,
    p_true_template,
)
from calm_runtime.errors import ConfigError
from calm_runtime.formats.engine import EngineManifest
from calm_runtime.inference import scoring_passes
from calm_runtime.inference._inputs import check_text, input_label, positive_int
from calm_runtime.inference.results import Choice
from calm_runtime.modes import CLOZE_VARIANTS, PTrueTemplate

logger = logging.getLogger("calm_runtime.inference.lm")

def recorded_cloze_variant(manifest: EngineManifest) -> str | None:
    """The cloze variant the engine's calibration was fitted with, if the manifest says.

    Read from ``export.cloze_variant``, or ``export.adapter_method.variant`` (the
    adapter's ``method`` section copied by calm-export); ``None`` when not recorded.
    """
    export = manifest.export or {}
    value = export.get("cloze_variant")
    if value is None and isinstance(export.get("adapter_method"), Mapping):
        value = export["adapter_method"].get("variant")
    return value if value in CLOZE_VARIANTS else None


class Judging:
    """Option probabilities and P(True) of a :class:`~calm_runtime.inference.lm.CalibratedLM`."""

    def choose(self, question: str, options: Sequence[str], mode: str = "cloze", *,
               variant: str | None = None, chat: bool | None = None) -> Choice:
        """Option probabilities of one multiple-choice question (see :meth:`choose_batch`)."""
        return self.choose_batch([question], [options], mode, variant=variant, chat=chat)[0]

    def choose_batch(self, questions: Sequence[str], options: Sequence[Sequence[str]],
                     mode: str = "cloze", *, variant: str | None = None,
                     chat: bool | None = None, batch_size: int = 8) -> list[Choice]:
        """Calibrated option probabilities, prediction and confidence per question.

        ``mode="letter"``: the options are listed as ``A. ...`` lines and scored by the
        option letters' calibrated logits (softmax over the K letters); the chat template
        is applied when the tokenizer has one unless ``chat=False`` (as in training).
        ``mode="cloze"``: each option's text is scored as the continuation of
        ``"Question: ...\\nAnswer:"`` by ``variant`` (default: the one the engine records,
        else ``"mean"``), and the probabilities are ``softmax(scores / answer_temperature)``.
        """
        scoring = modes.mode(mode, choice=True)
        if len(questions) != len(options):
            raise ConfigError(f"{len(questions)} questions but {len(options)} option lists; "
                              "pass one list of options per question")
        if not questions:
            raise ConfigError("no questions given; pass at least one")
        for q, opts in zip(questions, options, strict=True):
            _check_question(q, opts)
        size = positive_int(batch_size, "batch_size")
        if scoring.token_level:
            return self._choose_letters(questions, options, chat, size)
        variant = self._cloze_variant(variant)
        contexts, conts = [], []
        for n, (q, opts) in enumerate(zip(questions, options, strict=True)):
            which = input_label("question", n, len(questions))
            self._check_chars(q + max(opts, key=len, default=""),
                              f"{which} with its longest option",
                              "shorten the question or options")
            ids = self.tokenizer.encode(cloze_context(q))
            encoded = [self.tokenizer.encode(cloze_continuation(o), add_bos=False) for o in opts]
            if any(not c for c in encoded):
                raise ConfigError(f"an option of {q[:40]!r} encodes to no tokens; fix the option")
            longest = max(range(len(encoded)), key=lambda k: len(encoded[k]))
            self._check_length(len(ids) + len(encoded[longest]) - 1,
                               f"{input_label('question', n, len(questions))} with option "
                               f"{longest + 1} (question and option)",
                               "shorten the question or options")
            contexts.append(ids)
            conts.append(encoded)
        sums = scoring_passes.cloze_logprobs(self.backend, contexts, conts,
                                       self.tokenizer.pad_token_id, size,
                                       kv_bytes_per_token=self.kv_bytes_per_token)
        choices = []
        for total, cont, opts in zip(sums, conts, options, strict=True):
            scores = cloze_option_scores(total, [len(c) for c in cont],
                                         [option_char_count(o) for o in opts], variant)
            choices.append(_choice(scores, "cloze", variant, self.answer_temperature,
                                   self.abstain_below, self._option_calibration("cloze")))
        return choices

    def _cloze_variant(self, asked: str | None) -> str:
        """``asked``, or the recorded variant, by
        :func:`~calm_runtime.data.prompts.cloze_variant_for`: another variant than the one the
        answer temperature was fitted on is refused."""
        return cloze_variant_for(asked, self.recorded_variant,
                                 bound=self.answer_temperature is not None, what="the engine",
                                 fix="drop the variant to use the recorded one, or serve an "
                                     "engine whose calibration was fitted on that variant")

    def choose_continuation(self, prompt_ids: Sequence[int], options: Sequence[str], *,
                            variant: str | None = None, should_stop=None) -> Choice:
        """Calibrated probabilities of ``options`` as continuations of an encoded prompt, each
        option's text appended exactly as given (a constrained choice: the answer is one of
        the options). Cloze scoring by ``variant`` with the engine's answer temperature, as
        :meth:`choose` does for ``"Question: ...\nAnswer:"`` and ``" " + option``."""
        if isinstance(options, str) or not isinstance(options, Sequence) or len(options) < 2:
            raise ConfigError("options must be a list of at least 2 strings")
        for option in options:  # any number of choices: no letters are needed here
            if not isinstance(option, str) or not option.strip():
                raise ConfigError(f"every option must be a non-empty string, got {option!r}")
            check_text(option, "an option")
        variant = self._cloze_variant(variant)
        context = [int(i) for i in prompt_ids]
        if not context:
            raise ConfigError("the prompt is empty; a choice needs a context to continue")
        self._check_chars(max(options, key=len, default=""), "the longest choice",
                          "shorten the choices")
        encoded = [self.tokenizer.encode(o, add_bos=False) for o in options]
        empty = [k for k, c in enumerate(encoded) if not c]
        if empty:
            raise ConfigError(f"choice {empty[0]} ({options[empty[0]][:40]!r}) encodes to no "
                              "tokens; give non-empty choices")
        longest = max(len(c) for c in encoded)
        self._check_length(len(context) + longest - 1,
                           f"the prompt with its longest choice ({len(context)} + {longest} "
                           "tokens)", "shorten the prompt or the choices")
        sums = scoring_passes.cloze_logprobs(self.backend, [context], [encoded],
                                       self.tokenizer.pad_token_id, 1,
                                       kv_bytes_per_token=self.kv_bytes_per_token,
                                       should_stop=should_stop)[0]
        scores = cloze_option_scores(sums, [len(c) for c in encoded],
                                     [option_char_count(o) for o in options], variant)
        return _choice(scores, "cloze", variant, self.answer_temperature, self.abstain_below,
                       self._option_calibration("cloze"))

    def _choose_letters(self, questions, options, chat, size) -> list[Choice]:
        use_chat = self.tokenizer.use_chat(chat)
        table = self.manifest.option_tokens["chat" if use_chat else "plain"]
        prompts, ids = [], []
        for n, (q, opts) in enumerate(zip(questions, options, strict=True)):
            prompts.append(self._prompt_ids(
                letter_prompt(q, opts), use_chat,
                f"{input_label('question', n, len(questions))} as a letter-mode prompt",
                "shorten the question or options"))
            texts = letter_tokens(len(opts), chat=use_chat)
            missing = [t for t in texts if t not in table]
            if missing:
                raise ConfigError(f"option token {missing[0]!r} is not a single token in this "
                                  f"engine's tokenizer (it records {sorted(table)}); use "
                                  "mode='cloze' or fewer options")
            ids.append([table[t] for t in texts])
        logits = scoring_passes.next_token_logits(self.backend, prompts,
                                                  self.tokenizer.pad_token_id, size)
        by = self._option_calibration("letter")
        return [_choice(logits[n, token_ids].astype(np.float64), "letter", None, 1.0,
                        self.abstain_below, by)
                for n, token_ids in enumerate(ids)]

    def _option_calibration(self, mode: str) -> str | None:
        return self.calibrated_outputs_in(mode)["option_probabilities"]

    # ------------------------------------------------------------------ P(True)
    def p_true(self, question: str, answer: str, *,
               template: str | Mapping | PTrueTemplate | None = None,
               chat: bool | None = None) -> float:
        """P(True) that ``answer`` answers ``question`` (see :meth:`p_true_batch`)."""
        return float(self.p_true_batch([question], [answer], template=template, chat=chat)[0])

    def p_true_batch(self, questions: Sequence[str], answers: Sequence[str], *,
                     template: str | Mapping | PTrueTemplate | None = None,
                     chat: bool | None = None, batch_size: int = 16) -> np.ndarray:
        """``p(true) / (p(true) + p(false))`` under the calibrated next-token distribution.

        The template is the engine's recorded one unless ``template`` names a built-in
        (:func:`calm_runtime.data.prompts.p_true_template`) or gives a mapping. With the chat
        template (applied when the tokenizer has one unless ``chat=False``, as in
        training) the answer tokens lose their leading space.
        """
        if len(questions) != len(answers):
            raise ConfigError(f"{len(questions)} questions but {len(answers)} answers; pass one "
                              "answer per question")
        if not questions:
            raise ConfigError("no questions given; pass at least one")
        chosen = self.manifest.p_true() if template is None else p_true_template(template)
        use_chat = self.tokenizer.use_chat(chat)
        true_text, false_text = chosen.true_token, chosen.false_token
        if use_chat:
            true_text, false_text = true_text.lstrip(), false_text.lstrip()
        pair = [self.tokenizer.single_token_id(true_text, "the P(True) true token"),
                self.tokenizer.single_token_id(false_text, "the P(True) false token")]
        prompts = []
        for n, (q, a) in enumerate(zip(questions, answers, strict=True)):
            if not isinstance(q, str) or not q.strip() or not isinstance(a, str):
                raise ConfigError(f"P(True) needs a non-empty question and an answer string, got "
                                  f"{q!r} / {a!r}")
            label = f"the P(True) prompt of {input_label('question', n, len(questions))}"
            check_text(q, label)
            check_text(a, label)
            prompts.append(self._prompt_ids(chosen.render(q, a), use_chat, label,
                                            "shorten the question or the answer"))
        logits = scoring_passes.next_token_logits(self.backend, prompts,
                                                  self.tokenizer.pad_token_id,
                                                  positive_int(batch_size, "batch_size"))
        return modes.p_true_probability(logits[:, pair])


def _choice(scores: np.ndarray, mode: str, variant: str | None, temperature: float,
            abstain_below: float | None = None, calibrated_by: str | None = None) -> Choice:
    probs = modes.option_probabilities(np.asarray(scores, dtype=np.float64), temperature)
    best = int(np.argmax(probs))
    return Choice(probabilities=probs, prediction=best, confidence=float(probs[best]),
                  scores=np.asarray(scores, dtype=np.float64), mode=mode, variant=variant,
                  answer_temperature=temperature, calibrated_by=calibrated_by,
                  abstained=None if abstain_below is None else bool(probs[best] < abstain_below))


def _check_question(question, options) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"a question must be a non-empty string, got {question!r}")
    check_text(question, "a question")
    if isinstance(options, str) or not isinstance(options, Sequence):
        raise ConfigError(f"options must be a list of strings, got {type(options).__name__}")
    option_letters(len(options))  # 2..26 options, else a one-line ConfigError
    for option in options:
        if not isinstance(option, str) or not option.strip():
            raise ConfigError(f"every option must be a non-empty string, got {option!r}")
        check_text(option, "an option")
