"""``--dtype`` and ``--device``: resolved once (calm_runtime/placement.py), the same on every
command that loads a model, recorded where scores are kept."""

from __future__ import annotations

import json

import numpy as np
import pytest

from calm_runtime.errors import BackendUnavailableError, ConfigError
from calm_runtime.placement import Placement, check_device, check_dtype, checkpoint_dtype


def test_dtype_and_device_spellings_and_one_line_refusals():
    assert check_dtype("bf16") == "bfloat16" and check_dtype("FP16") == "float16"
    assert check_dtype("float32") == "float32" and check_dtype("auto") == "auto"
    with pytest.raises(ConfigError, match="dtype 'int3' is not one of auto, float32") as err:
        check_dtype("int3")
    assert "\n" not in str(err.value)
    assert check_device("CUDA:1") == "cuda:1"
    with pytest.raises(ConfigError, match="device 'gpu' is not one of auto, cpu, cuda"):
        check_device("gpu")


def test_auto_takes_the_checkpoints_dtype_and_the_cpu_here(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    resolved = Placement().resolve(tmp_path)
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved.device == expected and resolved.dtype == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float32"}))
    assert Placement("auto", "cpu").resolve(tmp_path) == Placement("float32", "cpu")
    (tmp_path / "config.json").write_text(json.dumps({}))  # names none: float32
    assert Placement("auto", "cpu").resolve(tmp_path).dtype == "float32"
    # the cache keeps float32-on-CPU keys as they were, and tells the others apart
    assert Placement("float32", "cpu").cache_suffix() == ""
    assert Placement("bfloat16", "cpu").cache_suffix() == "|bfloat16|cpu"


def test_a_cuda_device_torch_does_not_see_is_one_line():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(BackendUnavailableError, match="torch sees no CUDA device.*--device cpu"):
        Placement("float32", "cuda").resolve()


def test_models_load_straight_into_the_asked_dtype_and_score_in_float32(tiny_llama_untied):
    torch = pytest.importorskip("torch")
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_training.scoring.local import batched_logits

    model, tokenizer, _ = load_model_and_tokenizer(tiny_llama_untied, dtype="bf16",
                                                   device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.calm_placement == Placement("bfloat16", "cpu")
    reference, _, _ = load_model_and_tokenizer(tiny_llama_untied, dtype="float32",
                                               device="cpu")
    ids = [list(tokenizer("Question: a b c?\nAnswer:")["input_ids"])]
    low, high = batched_logits(model, ids, 1, 3), batched_logits(reference, ids, 1, 3)
    assert low.dtype == torch.float32  # upcast before any softmax
    np.testing.assert_allclose(low.numpy(), high.numpy(), atol=0.05)
    assert not np.array_equal(low.numpy(), high.numpy())  # it really ran in bfloat16


def test_fit_records_its_placement_and_keeps_bf16_scores_apart(tiny_llama_untied,
                                                               tiny_llama_tied, mc_file,
                                                               tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    from calm_runtime.formats.artifact import CalibrationAdapter
    from calm_training.fit import fit_adapter
    from calm_training.posthoc.fit_config import FitConfig
    from calm_training.scoring.sources import LocalModel

    written = {}
    for dtype in ("float32", "bfloat16"):
        config = FitConfig(model=str(tiny_llama_untied), reference=str(tiny_llama_tied),
                           data=str(mc_file), mode="cloze", bootstrap=0, dtype=dtype,
                           device="cpu")
        fit_adapter(config, "daca", tmp_path / dtype, progress=False)
        written[dtype] = CalibrationAdapter.from_pretrained(tmp_path / dtype)
    for dtype, adapter in written.items():
        for role in ("model", "reference"):
            assert adapter.provenance["placement"][role] == {"dtype": dtype, "device": "cpu"}
        assert adapter.method["settings"]["dtype"] == dtype
    keys = {dtype: LocalModel(str(tiny_llama_untied), placement=(dtype, "cpu")).fingerprint()
            for dtype in ("float32", "bfloat16")}
    assert keys["float32"] != keys["bfloat16"]
    with pytest.raises(ConfigError, match="dtype 'half-ish'"):
        FitConfig(model="m", data="d", dtype="half-ish")


def test_every_model_loading_command_takes_dtype_and_device():
    pytest.importorskip("torch")
    from calm_runtime.cli.main import build_parser

    parser = build_parser()
    for argv in (["fit", "ts", "--model", "m", "--data", "d", "--out", "o"],
                 ["eval", "--model", "m", "--data", "d", "--compare"],
                 ["score", "engine", "--data", "d"],
                 ["train", "--model", "m", "--train", "t", "--calibration", "c", "--out", "o"]):
        args = parser.parse_args([*argv, "--dtype", "bf16", "--device", "cpu"])
        assert (args.dtype, args.device) == ("bfloat16", "cpu"), argv
    from calm_export.cli import build_parser as export_parser

    args = export_parser().parse_args(["--model", "m", "--out", "o", "--dtype", "float16",
                                       "--device", "cuda"])
    assert (args.dtype, args.device) == ("fp16", "cuda")
    with pytest.raises(SystemExit):
        export_parser().parse_args(["--model", "m", "--out", "o", "--dtype", "bfloat16"])


def test_ids_past_the_tokenizer_are_never_chosen_and_confidences_stay_the_models():
    from calm_runtime.inference.sampling import (
        SamplingParams,
        choose_tokens,
        row_generators,
        step_stats,
    )

    logits = np.zeros((2, 8), dtype=np.float32)
    logits[:, 6] = 10.0  # a padded id the tokenizer cannot render is the argmax
    logits[1, 2] = 5.0
    stats = step_stats(logits)
    greedy = SamplingParams(temperature=0.0)
    assert choose_tokens(stats, greedy, [], valid=5).tolist() == [0, 2]
    assert choose_tokens(stats, greedy, []).tolist() == [6, 6]  # no limit: the head's own
    sampled = SamplingParams(temperature=1.0, top_p=0.999)
    for seed in range(20):
        picks = choose_tokens(stats, sampled, row_generators(seed, 2), valid=5)
        assert (picks < 5).all()
    # the confidence of a chosen id is its probability in the whole distribution
    full = np.exp(logits[1] - logits[1].max())
    np.testing.assert_allclose(stats.probability(np.array([1]), np.array([2])),
                               full[2] / full.sum(), rtol=1e-6)
