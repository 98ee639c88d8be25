"""The model-source resolver: a spec is told apart once (local model, engine, served model)
and everything after asks the source; a served model is connected on first use only."""

from __future__ import annotations

import pytest
from conftest import JSONHandler, loopback_server

from calm_runtime.data.models import model_fingerprint, model_identity
from calm_runtime.errors import ConfigError
from calm_training.posthoc.fit_config import FitConfig
from calm_training.posthoc.plan import FitPlan
from calm_training.scoring.endpoint import Endpoint
from calm_training.scoring.sources import (
    LocalModel,
    ServedModel,
    as_source,
    resolve_source,
)


@pytest.fixture
def server():
    seen: list[str] = []

    class Handler(JSONHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    with loopback_server(Handler) as url:
        yield url, seen


def test_a_local_folder_is_a_local_model(tiny_llama_tied):
    source = resolve_source(str(tiny_llama_tied))
    assert isinstance(source, LocalModel) and source.full_logits and not source.served
    assert source.identity() == model_identity(tiny_llama_tied)
    assert source.fingerprint() == model_fingerprint(tiny_llama_tied)
    assert source.folder() == tiny_llama_tied
    source.check_adapter("any/adapter")  # a LoRA/calibration can go on top
    source.require_uncalibrated("a fit")
    assert as_source(source) is source
    assert isinstance(as_source(str(tiny_llama_tied)), LocalModel)


def test_a_url_is_served_and_connected_on_first_use(server):
    url, seen = server
    config = FitConfig(model=url, data="arc-easy", mode="letter", reference=None,
                       api_key_env="CALM_TEST_KEY")
    plan = FitPlan.resolve(config)
    source = plan.model
    assert isinstance(source, ServedModel) and source.served and not source.full_logits
    assert plan.reference is None
    assert seen == []  # deciding the kind reads no network
    identity = source.identity()
    assert identity.served == {"endpoint": url, "served_model": "tiny"}
    assert seen == ["/v1/models"] or seen == ["/models"]
    source.identity()
    assert len(seen) == 1  # connected once per source
    assert source.endpoint.api_key_env == "CALM_TEST_KEY"
    with pytest.raises(ConfigError, match="served model is scored as it is served"):
        source.check_adapter("an/adapter")
    with pytest.raises(ConfigError, match="is served: its files are not on this machine"):
        source.folder()


def test_a_connected_endpoint_is_wrapped_without_reconnecting(server):
    url, seen = server
    endpoint = Endpoint(url, "tiny")
    source = as_source(endpoint)
    assert source.served and source.endpoint is endpoint and source.spec == url
    assert source.identity().served["served_model"] == "tiny"
    assert seen == []


def test_the_prompt_format_follows_the_chat_template(tiny_llama_tied, tmp_path):
    letter = FitConfig(model=str(tiny_llama_tied), data="arc-easy", mode="letter")
    has = (tiny_llama_tied / "chat_template.jinja").is_file() or "chat_template" in (
        tiny_llama_tied / "tokenizer_config.json").read_text(encoding="utf-8")
    assert FitPlan.resolve(letter).prompt_format == ("chat" if has else "plain")
    forced = FitConfig(model=str(tiny_llama_tied), data="arc-easy", mode="letter", chat=False)
    assert FitPlan.resolve(forced).prompt_format == "plain"
    cloze = FitConfig(model=str(tiny_llama_tied), data="arc-easy", mode="cloze", chat=True)
    assert FitPlan.resolve(cloze).prompt_format == "plain"


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json",
                                   "tokenizer_config.json", None])
def test_a_folder_has_a_chat_template_where_transformers_reads_one(tmp_path, where):
    """The one rule (the plan's prompt format, the letter scorer's prompts and the option
    tokens a vector fit writes on) finds a template where the tokenizer does, and only there
    (a processor's chat_template.json is not the tokenizer's)."""
    import json

    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tmp_path / "model"
    folder.mkdir()
    vocab = {"<unk>": 0, "A": 1, "B": 2}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "<unk>")),
                            unk_token="<unk>").save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if where == "tokenizer_config.json":
        config["chat_template"] = template
    elif where == "chat_template.json":
        (folder / where).write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    elif where is not None:
        (folder / where).write_text(template, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    source = LocalModel(str(folder))
    loaded = bool(AutoTokenizer.from_pretrained(str(folder)).chat_template)
    assert source.chat(None) == loaded == (where in ("chat_template.jinja",
                                                     "tokenizer_config.json"))
    assert source.chat(False) is False and source.chat(True) is True
