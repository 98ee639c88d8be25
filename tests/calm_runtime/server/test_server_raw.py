"""Raw (uncalibrated) log-probabilities beside the calibrated ones: ``raw_logprobs`` in the
runtime and ``"calm": {"raw_logprobs": true}`` in ``calm serve``, checked against the source
model's own logits in torch; engines with per-token calibration refuse them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import RUNTIME_CHAT_TEMPLATE, tiny_llama_dir  # noqa: E402

from calm_runtime.errors import ConfigError  # noqa: E402

TEMPERATURE = 1.7
PROMPT = "The cat sat on the"


@pytest.fixture(scope="module")
def temperature_engine(tmp_path_factory):
    """``(model_dir, engine_dir)``: a tiny model exported with a temperature-only adapter."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter

    model_dir = tiny_llama_dir(tmp_path_factory, tied=True, seed=21, name="raw-llama")
    (model_dir / "chat_template.jinja").write_text(RUNTIME_CHAT_TEMPLATE, encoding="utf-8")
    adapter = CalibrationAdapter.identity(model_identity(model_dir), temperature=TEMPERATURE,
                                          kind="test")
    adapter_dir = tmp_path_factory.mktemp("raw-adapter") / "adapter"
    adapter.save_pretrained(adapter_dir)
    engine_dir = tmp_path_factory.mktemp("raw-engine") / "engine"
    export_engine(model_dir, engine_dir, adapter=adapter_dir,
                  config=ExportConfig(greedy_steps=4, progress=False, exporter="torchscript"))
    return model_dir, engine_dir


@pytest.fixture(scope="module")
def lm(temperature_engine):
    from calm_runtime.inference.lm import CalibratedLM

    model = CalibratedLM.load(temperature_engine[1], threads=1)
    yield model
    model.close()


def _torch_log_softmax(model_dir, ids: list[int]) -> np.ndarray:
    """``[len(ids), V]`` log-softmax of the source model's own logits (no calibration)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def test_raw_logprobs_are_the_models_own(lm, temperature_engine):
    assert lm.raw_logit_scale == pytest.approx(TEMPERATURE)
    out = lm.generate(PROMPT, 6, top_alternatives=3, raw_logprobs=True)
    prompt_ids = lm.encode_prompt(PROMPT)
    ids = prompt_ids + [t.id for t in out.tokens]
    want = _torch_log_softmax(temperature_engine[0], ids)
    for step, token in enumerate(out.tokens):
        row = want[len(prompt_ids) - 1 + step]
        assert token.raw_logprob == pytest.approx(row[token.id], abs=1e-4)
        # the calibrated ones are the temperature's: log_softmax(z / T)
        cal = torch.log_softmax(torch.tensor(row) / TEMPERATURE, -1).numpy()
        assert token.logprob == pytest.approx(cal[token.id], abs=1e-4)
        assert [a.raw_logprob for a in token.top] == pytest.approx(
            [row[a.id] for a in token.top], abs=1e-4)
    plain = lm.generate(PROMPT, 6)
    assert [t.id for t in plain.tokens] == [t.id for t in out.tokens]
    assert all(t.raw_logprob is None for t in plain.tokens)

    scored = lm.prompt_logprobs(PROMPT, top=2, raw_logprobs=True)
    want = _torch_log_softmax(temperature_engine[0], [t.id for t in scored])
    assert scored[0].raw_logprob is None
    for t, token in enumerate(scored[1:], start=1):
        assert token.raw_logprob == pytest.approx(want[t - 1, token.id], abs=1e-4)


def test_per_token_calibration_refuses_raw(runtime_lm):
    with pytest.raises(ConfigError, match="per-token calibration.*cannot be recovered"):
        _ = runtime_lm.raw_logit_scale
    with pytest.raises(ConfigError, match="per-token calibration"):
        runtime_lm.generate(PROMPT, 2, raw_logprobs=True)


@pytest.fixture(scope="module")
def client(temperature_engine):
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    config = ServeConfig(engine=str(temperature_engine[1]), model_name="raw", threads=1)
    with serve_in_background(create_app(config)) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_served_raw_logprobs_beside_the_calibrated(client, lm):
    raw = {"calm": {"raw_logprobs": True}}
    want = lm.generate(PROMPT, 5, top_alternatives=2, raw_logprobs=True).tokens
    out = client.completions.create(model="raw", prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body=raw)
    got = out.choices[0].model_extra["calm"]["raw_logprobs"]
    assert got["tokens"] == out.choices[0].logprobs.tokens
    np.testing.assert_allclose(got["token_logprobs"], [t.raw_logprob for t in want], atol=1e-5)
    np.testing.assert_allclose(out.choices[0].logprobs.token_logprobs,
                               [t.logprob for t in want], atol=1e-5)
    for served, token in zip(got["top_logprobs"], want, strict=True):
        expected = {a.text: a.raw_logprob for a in token.top}  # as OpenAI's object keys them
        assert served.keys() == expected.keys()
        np.testing.assert_allclose(list(served.values()), list(expected.values()), atol=1e-5)

    chat = client.chat.completions.create(model="raw", max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logprobs=True, top_logprobs=1, extra_body=raw)
    content = chat.choices[0].model_extra["calm"]["raw_logprobs"]["content"]
    assert [c["token"] for c in content] == [c.token for c in chat.choices[0].logprobs.content]
    assert all(c["logprob"] > cal.logprob - 10 for c, cal in
               zip(content, chat.choices[0].logprobs.content, strict=True))

    echo = client.completions.create(model="raw", prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=0, extra_body=raw)
    scored = lm.prompt_logprobs(PROMPT, raw_logprobs=True)
    got = echo.choices[0].model_extra["calm"]["raw_logprobs"]["token_logprobs"]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], [t.raw_logprob for t in scored[1:]], atol=1e-5)

    stream = client.completions.create(model="raw", prompt=PROMPT, max_tokens=3, temperature=0,
                                       logprobs=0, stream=True, extra_body=raw)
    streamed = [c.choices[0].model_extra["calm"]["raw_logprobs"]["token_logprobs"][0]
                for c in stream if c.choices[0].finish_reason is None]
    np.testing.assert_allclose(streamed, [t.raw_logprob for t in want[:3]], atol=1e-5)


def test_raw_logprobs_refusals(client, runtime_openai):
    raw = {"calm": {"raw_logprobs": True}}
    with pytest.raises(openai.BadRequestError, match="raw_logprobs needs logprobs"):
        client.completions.create(model="raw", prompt=PROMPT, max_tokens=2, extra_body=raw)
    with pytest.raises(openai.BadRequestError, match="per-token calibration"):
        runtime_openai.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                          logprobs=1, extra_body=raw)


def test_every_response_says_which_outputs_are_calibrated(client, lm):
    """The calm object names the fit behind the token log-probabilities (here the test
    adapter's temperature, so logprobs differ from raw_logprobs by exactly T)."""
    out = client.completions.create(model="raw", prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=0, extra_body={"calm": {"raw_logprobs": True}})
    extension = out.choices[0].model_extra["calm"]
    assert extension["calibrated"] == lm.calibrated_outputs
    assert extension["calibrated"]["token_logprobs"] == "test"
    assert extension["calibrated"]["p_true"] is None
    raw = np.array(extension["raw_logprobs"]["token_logprobs"])
    assert not np.allclose(raw, out.choices[0].logprobs.token_logprobs, atol=1e-3)


@pytest.fixture(scope="module")
def cloze_only_engine(tmp_path_factory):
    """An engine exported from an adapter with a cloze answer temperature and nothing for
    the head (a cross-tokenizer DACA fit)."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter

    model_dir = tiny_llama_dir(tmp_path_factory, tied=True, seed=22, name="cloze-only-llama")
    adapter = CalibrationAdapter.identity(model_identity(model_dir), answer_temperature=2.0,
                                          kind="daca",
                                          method={"name": "daca", "mode": "cloze",
                                                  "variant": "mean",
                                                  "token_fit": {"fitted": False,
                                                                "reason": "tokenizers differ"}})
    adapter_dir = tmp_path_factory.mktemp("cloze-only-adapter") / "adapter"
    adapter.save_pretrained(adapter_dir)
    engine_dir = tmp_path_factory.mktemp("cloze-only-engine") / "engine"
    export_engine(model_dir, engine_dir, adapter=adapter_dir,
                  config=ExportConfig(greedy_steps=2, progress=False, exporter="torchscript"))
    return engine_dir


def test_a_cloze_only_engine_says_its_token_logprobs_are_uncalibrated(cloze_only_engine,
                                                                      capsys):
    from calm_runtime.cli.main import main
    from calm_runtime.inference.lm import CalibratedLM
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    engine = CalibratedLM.load(cloze_only_engine, threads=1)
    outputs = engine.calibrated_outputs
    engine.close()
    assert outputs["token_logprobs"] is None
    assert outputs["option_probabilities"] == "daca: cloze answer temperature 2"
    config = ServeConfig(engine=str(cloze_only_engine), model_name="c", threads=1)
    with serve_in_background(create_app(config)) as (url, _):
        plain = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = plain.completions.create(model="c", prompt=PROMPT, max_tokens=2, temperature=0,
                                       logprobs=0, extra_body={"calm": {"raw_logprobs": True}})
        extension = out.choices[0].model_extra["calm"]
        assert extension["calibrated"]["token_logprobs"] is None
        np.testing.assert_allclose(extension["raw_logprobs"]["token_logprobs"],
                                   out.choices[0].logprobs.token_logprobs, atol=1e-5)
        chosen = plain.completions.create(model="c", prompt=PROMPT, max_tokens=2,
                                          extra_body={"guided_choice": ["mat", "hat"]})
        assert chosen.choices[0].model_extra["calm"]["calibrated"] == outputs
    assert main(["generate", str(cloze_only_engine), PROMPT, "--max-new-tokens", "2"]) == 0
    shown = capsys.readouterr().out
    assert "UNCALIBRATED" in shown and "calibrated probability" not in shown


def test_another_variant_than_the_answer_temperature_was_fitted_on_is_refused(
        cloze_only_engine):
    """One policy (docs/cli.md): the recorded variant is the default; another one is a
    one-line error, not a warning beside numbers the temperature does not fit."""
    from calm_runtime.errors import ConfigError
    from calm_runtime.inference.lm import CalibratedLM

    engine = CalibratedLM.load(cloze_only_engine, threads=1)
    try:
        recorded = engine.choose("Which is a pet?", ["a cat", "a rock"])
        assert recorded.variant == "mean"
        same = engine.choose("Which is a pet?", ["a cat", "a rock"], variant="mean")
        np.testing.assert_array_equal(same.probabilities, recorded.probabilities)
        with pytest.raises(ConfigError, match="fitted on 'mean' cloze scores, not 'sum'"):
            engine.choose("Which is a pet?", ["a cat", "a rock"], variant="sum")
        with pytest.raises(ConfigError, match="fitted on 'mean' cloze scores, not 'char'"):
            engine.choose_continuation(engine.tokenizer.encode(PROMPT), ["mat", "hat"],
                                       variant="char")
    finally:
        engine.close()
