"""Scoring on a tiny random model equals a direct, unbatched computation."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from calm_runtime.data.prompts import (  # noqa: E402
    cloze_context,
    cloze_continuation,
    letter_prompt,
    p_true_template,
)
from calm_runtime.data.sets import MultipleChoiceRecord  # noqa: E402
from calm_runtime.errors import ConfigError, DataError  # noqa: E402
from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity  # noqa: E402
from calm_training.scoring.answers import score_p_true  # noqa: E402
from calm_training.scoring.local import (  # noqa: E402
    is_correct,
    normalize_answer,
    score_multiple_choice,
)

WORDS = ("question answer the a of is to in what which cat dog sun moon red blue green "
         "water fire earth air A B C D E True False Yes No proposed correct").split()


@pytest.fixture(scope="module")
def tiny():
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    for word in WORDS + ["Question", "Answer", ":", "\n", ".", "?", "(", ")", "Proposed",
                         "Is", "The", "answer:", "(A)", "(B)"]:
        vocab.setdefault(word, len(vocab))
        vocab.setdefault("▁" + word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # zero-width spaces vanish, so an option made of them tokenises to nothing
    backend.normalizer = normalizers.Sequence([normalizers.Replace("\u200b", ""),
                                               normalizers.Replace(Regex("^ +$"), "")])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Metaspace(prepend_scheme="never")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>",
                                  unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab) + 7, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=2,
                         eos_token_id=3)
    model = LlamaForCausalLM(config).eval()
    return model, tok


RECORDS = [
    MultipleChoiceRecord("what is red", ("fire", "water", "the blue sun", "dog"), 0),
    MultipleChoiceRecord("which cat is blue", ("A dog", "moon"), 1),
    MultipleChoiceRecord("what is the earth of the air in water", ("cat", "dog", "sun"), None),
]


def _direct_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].double()


def test_cloze_scores_equal_unbatched_computation(tiny):
    model, tok = tiny
    scores = score_multiple_choice(model, tok, RECORDS, mode="cloze", batch_size=2,
                                   progress=False)
    for row, record in enumerate(RECORDS):
        ctx = tok(cloze_context(record.question))["input_ids"]
        for k, option in enumerate(record.choices):
            cont = tok(cloze_continuation(option), add_special_tokens=False)["input_ids"]
            logp = _direct_logits(model, ctx + cont).log_softmax(-1)
            expected = sum(float(logp[len(ctx) + t - 1, c]) for t, c in enumerate(cont))
            assert scores.values[row, k] == pytest.approx(expected, abs=1e-4)
            assert scores.n_tokens[row, k] == len(cont)
    assert np.isnan(scores.values[1, 2]) and np.isnan(scores.values[2, 3])
    assert scores.scores("sum")[1, 2] == -np.inf
    assert list(scores.labels) == [0, 1, -1]


def test_batch_size_does_not_change_scores(tiny):
    model, tok = tiny
    one = score_multiple_choice(model, tok, RECORDS, mode="cloze", batch_size=1, progress=False)
    three = score_multiple_choice(model, tok, RECORDS, mode="cloze", batch_size=3,
                                  progress=False)
    np.testing.assert_allclose(one.values, three.values, atol=1e-4)
    for variant in ("mean", "char"):
        assert np.isfinite(one.scores(variant)[0]).all()


def test_letter_scores_equal_unbatched_computation(tiny):
    model, tok = tiny
    scores = score_multiple_choice(model, tok, RECORDS, mode="letter", batch_size=2,
                                   chat=False, progress=False)
    for row, record in enumerate(RECORDS):
        ids = tok(letter_prompt(record.question, record.choices))["input_ids"]
        last = _direct_logits(model, ids)[-1]
        letters = [tok("▁" + c, add_special_tokens=False)["input_ids"][0]
                   for c in "ABCD"[:len(record.choices)]]
        np.testing.assert_allclose(scores.values[row, :len(letters)], last[letters].numpy(),
                                   atol=1e-4)


def test_calibration_is_applied_to_full_vocabulary(tiny):
    model, tok = tiny
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    adapter = CalibrationAdapter(ModelIdentity("tiny", vocab),
                                 tau=rng.uniform(0.5, 2.0, vocab), shift=rng.normal(0, 1, vocab),
                                 temperature=1.7)
    scores = score_multiple_choice(model, tok, RECORDS[:1], mode="cloze", calibration=adapter,
                                   progress=False)
    record = RECORDS[0]
    ctx = tok(cloze_context(record.question))["input_ids"]
    cont = tok(cloze_continuation(record.choices[2]), add_special_tokens=False)["input_ids"]
    logp = adapter.calibrate(_direct_logits(model, ctx + cont).float()).log_softmax(-1)
    expected = sum(float(logp[len(ctx) + t - 1, c]) for t, c in enumerate(cont))
    assert scores.values[0, 2] == pytest.approx(expected, abs=1e-4)


def test_p_true_matches_direct_computation(tiny):
    model, tok = tiny
    template = p_true_template({"template": "Question: {question} Answer: {answer} True or "
                                            "False ?", "true_token": " True",
                                "false_token": " False"})
    out = score_p_true(model, tok, ["what is red", "which cat"], ["fire", "the dog"], template,
                       chat=False, progress=False)
    ids = tok(template.render("which cat", "the dog"))["input_ids"]
    last = _direct_logits(model, ids)[-1]
    t, f = (tok(x, add_special_tokens=False)["input_ids"][0] for x in (" True", " False"))
    np.testing.assert_allclose(out[1], [float(last[t]), float(last[f])], atol=1e-4)


def test_bad_input(tiny):
    model, tok = tiny
    with pytest.raises(DataError, match="tokenises to nothing"):
        score_multiple_choice(model, tok, [MultipleChoiceRecord("what", ("cat", "\u200b"), 0)],
                              progress=False)
    with pytest.raises(ConfigError, match="unknown mode"):
        score_multiple_choice(model, tok, RECORDS, mode="words", progress=False)
    with pytest.raises(ConfigError, match="chat template"):
        score_multiple_choice(model, tok, RECORDS, mode="letter", chat=True, progress=False)


def test_answer_normalisation():
    assert normalize_answer("The  Sunset Blvd.") == "sunset blvd"
    assert is_correct("Sunset Boulevard, a musical", ["Sunset Boulevard"])
    assert not is_correct("Sunset", ["Sunset Boulevard"])
    assert not is_correct("", ["x"])


# --- context length -------------------------------------------------------------------------

def test_a_record_longer_than_the_context_is_a_one_line_error_naming_it(tiny):
    model, tok = tiny  # max_position_embeddings 256
    long = MultipleChoiceRecord(" ".join(["water"] * 300), ("fire", "dog"), 0, id="long-1")
    for mode in ("cloze", "letter"):
        with pytest.raises(DataError) as info:
            score_multiple_choice(model, tok, [RECORDS[0], long], mode=mode, chat=False,
                                  progress=False)
        message = str(info.value)
        assert "record 1, id 'long-1'" in message and "256-token context" in message
        assert "\n" not in message
    # a smaller configured maximum refuses what the model's context would take
    with pytest.raises(DataError, match="record 0.*more than the 4-token context"):
        score_multiple_choice(model, tok, RECORDS[:1], mode="cloze", progress=False,
                              max_length=4)
    with pytest.raises(DataError, match="P\\(True\\) prompt 0"):
        score_p_true(model, tok, [long.question], ["fire"], p_true_template("kadavath"),
                     chat=False, progress=False)


def test_a_huge_record_is_refused_before_it_is_tokenised(tiny, monkeypatch):
    from calm_training.scoring import local as scoring

    model, tok = tiny
    huge = MultipleChoiceRecord("water " * 200_000, ("fire", "dog"), 0)
    seen = []
    real = scoring.encode_text
    monkeypatch.setattr(scoring, "encode_text", lambda t, text, **k: seen.append(len(text))
                        or real(t, text, **k))
    with pytest.raises(DataError, match=r"record 0 .* is 1,200,018 characters, far more"):
        score_multiple_choice(model, tok, [huge], mode="cloze", progress=False)
    assert max(seen, default=0) < 1000  # only the option texts were tokenised


def test_batches_keep_padded_tokens_within_the_budget():
    from calm_training.scoring.local import BATCH_TOKENS_PER_ROW, token_batches

    lengths = [4000, 3000, 600, 500, 10, 10, 10, 10, 10, 10]
    chunks = list(token_batches(list(range(10)), 4, lengths))
    assert [i for c in chunks for i in c] == list(range(10))
    for chunk in chunks:
        assert len(chunk) <= 4
        assert len(chunk) == 1 or max(lengths[i] for i in chunk) * len(chunk) <= \
            4 * BATCH_TOKENS_PER_ROW
    assert chunks[:2] == [[0], [1]] and [5, 6, 7, 8] in chunks  # short ones: full batches


@pytest.mark.parametrize("budget", [1, 3000])
def test_scores_sized_by_what_they_allocate_equal_the_batched_ones(tiny, monkeypatch, budget):
    """Under a tiny budget every question's options are scored one by one in segments of
    positions (1 byte: one position at a time; 3,000: a few): the same scores, calibrated
    or not."""
    from calm_training.scoring import local as scoring

    model, tok = tiny
    rng = np.random.default_rng(0)
    adapter = CalibrationAdapter.identity(ModelIdentity("t", model.config.vocab_size),
                                          temperature=1.7)
    adapter.tau = np.exp(rng.normal(0, 0.2, model.config.vocab_size)).astype(np.float32)
    for calibration in (None, adapter):
        want = score_multiple_choice(model, tok, RECORDS, mode="cloze", progress=False,
                                     calibration=calibration)
        monkeypatch.setattr(scoring, "SCORING_BUDGET_BYTES", budget)
        got = score_multiple_choice(model, tok, RECORDS, mode="cloze", progress=False,
                                    calibration=calibration)
        monkeypatch.undo()
        np.testing.assert_allclose(got.values, want.values, atol=1e-4)


# The child's own peak (VmHWM, the high-water mark of its address space), not ru_maxrss:
# Linux carries the parent's peak into a child's ru_maxrss across fork and exec, so a
# long test session's size would be measured instead of the scorer's.
CHILD_LONG_OPTIONS = r"""
import json, sys
from calm_training.fit import FitConfig, compare_methods
config = FitConfig(model=sys.argv[1], data=sys.argv[2], mode="cloze", bootstrap=0)
compare_methods(config, ("vanilla", "ts"), progress=False)
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:")))
"""


def test_long_options_are_scored_within_a_memory_budget(tmp_path_factory, tmp_path):
    """4 options of ~1,900 tokens with a 32,768-token vocabulary: scored at once, their logits
    alone are ~3 GB; sized by what they allocate, the whole fit stays far below."""
    import json
    import os
    import subprocess
    import sys

    from conftest import tiny_llama_dir

    model_dir = tiny_llama_dir(tmp_path_factory, tied=True, seed=41, vocab_size=32768,
                               name="wide-llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    config["dtype"] = config["torch_dtype"] = "float32"  # what is measured: a float32 model
    (model_dir / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghij"))
    rows = [{"question": f"q{i}?", "choices": ["".join(rng.choice(letters, 1900))
                                                for _ in range(4)], "answer": i % 4}
            for i in range(4)]
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # the child's environment is the process's essentials only: what earlier tests left in
    # os.environ must not change what is measured
    keep = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SSL_CERT_FILE")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["CALM_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", CHILD_LONG_OPTIONS, str(model_dir), str(data)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.strip().splitlines()[-1])
    print(f"child peak RSS {peak / 2**30:.2f} GB")
    assert peak < 1.5 * 2**30, f"peak RSS {peak / 2**30:.2f} GB"
