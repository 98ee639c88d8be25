"""Letter-mode calibration of a served chat model equals the local one (issue: served chat
models). A tiny chat model is exported and served by a real `calm serve` process; `calm fit
daca --mode letter` through the endpoint and on the local folder, both with default options
(chat: the model has a template, the endpoint serves chat completions), give the same
temperature, and so do both with --no-chat; the adapter records the prompt format."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")

from conftest import (  # noqa: E402
    RUNTIME_CHAT_TEMPLATE,
    calm_serve_process,
    tiny_llama_config,
    tiny_tokenizer,
    write_mc_jsonl,
)

from calm_training.fit import fit_adapter  # noqa: E402
from calm_training.posthoc.fit_config import FitConfig  # noqa: E402


def _letter_model(folder, seed: int):
    """A tiny chat Llama whose option letters are always among its 20 most probable next
    tokens (a large constant in every embedding's first dimension, read by the head with
    +1 for the letters and -1 for every other token), so that a served model's top-20
    logprobs carry every letter exactly; the letters' own logits vary with the prompt."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tied=False)).eval()
    tok = tiny_tokenizer()
    letters = [tok.convert_tokens_to_ids(t) for t in ("A", "B", "C", "D")]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        model.lm_head.weight[:, 0] = -1.0
        for i in letters:
            model.lm_head.weight[i, 0] = 1.0
            model.lm_head.weight[i, 1:] = torch.randn(model.config.hidden_size - 1) * 2.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(RUNTIME_CHAT_TEMPLATE, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    root = tmp_path_factory.mktemp("served-chat")
    model = _letter_model(root / "model", seed=51)
    reference = _letter_model(root / "reference", seed=52)
    engine = root / "engine"
    export_engine(model, engine, config=ExportConfig(greedy_steps=2, progress=False,
                                                     exporter="torchscript"))
    with calm_serve_process(engine, name="chatty") as (url, _):
        yield url, model, reference


@pytest.mark.parametrize("chat", [None, False], ids=["defaults", "no-chat"])
def test_served_letter_fit_equals_the_local_one(served, tmp_path, monkeypatch, chat):
    monkeypatch.setenv("CALM_CACHE", str(tmp_path / "cache"))
    url, model, reference = served
    data = write_mc_jsonl(tmp_path / "mc.jsonl", n=60)
    fits = {}
    for where, spec in (("local", str(model)), ("served", url)):
        config = FitConfig(model=spec, reference=str(reference), data=str(data), mode="letter",
                           chat=chat, bootstrap=0)
        adapter, report = fit_adapter(config, "daca", tmp_path / where, progress=False)
        fits[where] = (adapter, report)
    local, served_fit = (fits[w][1]["fit"] for w in ("local", "served"))
    assert served_fit["n_used"] == local["n_used"]
    assert served_fit["temperature"] == pytest.approx(local["temperature"], rel=0.01)
    want = "plain" if chat is False else "chat"
    assert {fits[w][0].provenance["prompt_format"] for w in fits} == {want}
    assert np.isfinite(local["temperature"])
