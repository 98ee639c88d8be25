"""Shared test fixtures: tiny random Llama models with a real tokenizer, LoRA adapters.

Everything is built offline from a fixed seed in a temporary directory. Keep fixtures in
clearly named functions; the ``tiny_llama_*`` helpers need torch and transformers and
import them lazily, so test modules that do not use them stay torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import string
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

# pytest's default "prepend" import mode puts this folder (tests/) on sys.path to import this
# file. There, tests/calm_runtime/ and tests/calm_export/ (folders of tests, no __init__.py)
# would shadow the installed packages as namespace packages whenever the current directory
# is not the repository root. Take it off again; test modules do not import each other.
_HERE = os.path.realpath(os.path.dirname(__file__))
sys.path[:] = [p for p in sys.path if not p or os.path.realpath(p) != _HERE]


def _families():
    """tests/families.py (the conformance matrix), loaded by its path: ``from conftest
    import FAMILIES``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("families", os.path.join(_HERE,
                                                                           "families.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("families", module)
    spec.loader.exec_module(module)
    return module


FAMILIES = _families().FAMILIES

TINY_VOCAB = 300
TINY_SPECIALS = ("<|endoftext|>", "<s>", "</s>", "<pad>")  # ids 0..3: unk, bos, eos, pad


def tiny_tokenizer():
    """A byte-level BPE tokenizer (every string encodes) with " A".." J" as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TINY_SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges = [("Ġ", letter) for letter in string.ascii_uppercase[:10]]
    merges += [("Ġ", "Y"), ("e", "s"), ("ĠY", "es"), ("Ġ", "N"), ("ĠN", "o")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<|endoftext|>")


def tiny_llama_config(*, tied: bool, vocab_size: int = TINY_VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       max_position_embeddings=256, tie_word_embeddings=tied,
                       initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def tiny_llama_dir(tmp_path_factory, tied: bool, *, seed: int = 0, vocab_size: int = TINY_VOCAB,
                   name: str | None = None):
    """Save a 2-layer random Llama (tied or untied head) with the tiny tokenizer; return dir."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tied=tied, vocab_size=vocab_size)).eval()
    folder = tmp_path_factory.mktemp(name or f"tiny-llama-{'tied' if tied else 'untied'}")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def tiny_lora_dir(tmp_path_factory, model_dir, *, seed: int = 1):
    """A peft LoRA (r=4 on q_proj, v_proj) with random, nonzero B so the merge matters."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    folder = tmp_path_factory.mktemp("tiny-lora")
    peft_model.save_pretrained(folder)
    return folder


def random_calibration_adapter(model_dir, *, lora_dir=None, seed: int = 2,
                               temperature: float = 1.3):
    """A CalibrationAdapter with random positive tau, random shift and temperature."""
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter

    identity = model_identity(model_dir)
    rng = np.random.default_rng(seed)
    tau = np.exp(rng.normal(0.0, 0.3, identity.vocab_size)).astype(np.float32)
    shift = rng.normal(0.0, 0.5, identity.vocab_size).astype(np.float32)
    return CalibrationAdapter(base_model=identity, tau=tau, shift=shift, temperature=temperature,
                              answer_temperature=0.9, lora_path=lora_dir, kind="test")


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, tied=True)


@pytest.fixture(scope="session")
def tiny_llama_untied(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, tied=False, seed=3)


@pytest.fixture(scope="session")
def tiny_lora_tied(tmp_path_factory, tiny_llama_tied):
    return tiny_lora_dir(tmp_path_factory, tiny_llama_tied)


@pytest.fixture(scope="session")
def tiny_lora_untied(tmp_path_factory, tiny_llama_untied):
    return tiny_lora_dir(tmp_path_factory, tiny_llama_untied, seed=4)


# ---------------------------------------------------------------------- runtime fixtures
# Appended for the calm_runtime tests (tests/calm_runtime/test_runtime_*.py): one calibrated
# engine exported once per session from a tiny Llama with a chat template, a LoRA and a
# random calibration adapter; the tests compare the runtime against a torch reference.

RUNTIME_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }}\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}")


def runtime_engine_parts(tmp_path_factory):
    """``(model_dir, adapter_dir, engine_dir)``: a tiny chat model, its adapter, its engine."""
    from calm_export.config import ExportConfig
    from calm_export.pipeline import export_engine

    model_dir = tiny_llama_dir(tmp_path_factory, tied=True, seed=11, name="runtime-llama")
    (model_dir / "chat_template.jinja").write_text(RUNTIME_CHAT_TEMPLATE, encoding="utf-8")
    lora_dir = tiny_lora_dir(tmp_path_factory, model_dir, seed=12)
    adapter = random_calibration_adapter(model_dir, lora_dir=lora_dir, seed=13,
                                         temperature=1.2)
    adapter_dir = tmp_path_factory.mktemp("runtime-adapter") / "adapter"
    adapter.save_pretrained(adapter_dir)
    engine_dir = tmp_path_factory.mktemp("runtime-engine") / "engine"
    # the default graph (onnxruntime-genai's builder, packed I/O, ~9 s): the runtime's tests
    # run what calm-export makes by default
    export_engine(model_dir, engine_dir, adapter=adapter_dir,
                  config=ExportConfig(greedy_steps=4, progress=False))
    return model_dir, adapter_dir, engine_dir


@pytest.fixture(scope="session")
def runtime_engine(tmp_path_factory):
    """See :func:`runtime_engine_parts` (exported once per test session)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    return runtime_engine_parts(tmp_path_factory)


@pytest.fixture(scope="session")
def runtime_reference_model(runtime_engine):
    """``(model, adapter)``: the engine's source model with its LoRA merged (torch, eval) and
    the CalibrationAdapter whose ``calibrate`` gives the reference's calibrated logits."""
    from calm_runtime.data.models import load_model_and_tokenizer
    from calm_runtime.formats.artifact import CalibrationAdapter

    model_dir, adapter_dir, _ = runtime_engine
    adapter = CalibrationAdapter.from_pretrained(adapter_dir)
    model, _, _ = load_model_and_tokenizer(model_dir, lora_path=adapter.lora_path)
    return model, adapter


@pytest.fixture(scope="module")
def torch_single_thread():
    """Run torch on one thread: tiny models gain nothing from intra-op parallelism, and on a
    shared 2-core machine the thread hand-offs cost more than the arithmetic."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def genai_greedy(engine_dir, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy tokens onnxruntime-genai generates from an engine (it stops at EOS)."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    model = og.Model(str(engine_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray([prompt_ids], dtype=np.int32))
    generated = []
    while not generator.is_done():
        generator.generate_next_token()
        generated.append(int(generator.get_next_tokens()[0]))
    return generated


def _pb_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _pb_message(number: int, payload: bytes) -> bytes:
    return _pb_varint(number << 3 | 2) + _pb_varint(len(payload)) + payload


def synthetic_onnx_graph(*locations: str) -> bytes:
    """A minimal ONNX ``ModelProto`` (hand-encoded: no onnx needed) whose graph has one
    float initializer per name in ``locations``, each stored as external data in that file;
    none: a graph without external data. Enough for the loader's external-data check."""
    graph = _pb_message(2, b"synthetic")  # GraphProto.name
    for i, location in enumerate(locations):
        entries = b"".join(_pb_message(13, _pb_message(1, key.encode()) + _pb_message(2, value))
                           for key, value in (("location", location.encode()),
                                              ("offset", b"0"), ("length", b"4")))
        tensor = (_pb_varint(1 << 3) + _pb_varint(1)  # dims [1]
                  + _pb_varint(2 << 3) + _pb_varint(1)  # data_type FLOAT
                  + _pb_message(8, f"w{i}".encode())  # name
                  + entries + _pb_varint(14 << 3) + _pb_varint(1))  # data_location EXTERNAL
        graph += _pb_message(5, tensor)  # GraphProto.initializer
    return _pb_varint(1 << 3) + _pb_varint(8) + _pb_message(7, graph)  # ir_version, graph


def synthetic_genai_config(*, layers: int = 1, heads: int = 2, kv_heads: int = 1,
                           head_size: int = 4, hidden: int = 8, vocab: int = 300,
                           context: int = 64) -> str:
    """``genai_config.json`` text for a synthetic engine (the defaults match
    :func:`synthetic_engine_manifest`'s model section)."""
    return json.dumps({
        "model": {"bos_token_id": 1, "context_length": context, "eos_token_id": [2],
                  "pad_token_id": 3, "type": "llama", "vocab_size": vocab,
                  "decoder": {"filename": "model.onnx", "head_size": head_size,
                              "hidden_size": hidden, "num_attention_heads": heads,
                              "num_hidden_layers": layers, "num_key_value_heads": kv_heads}},
        "search": {"max_length": context, "min_length": 0, "num_beams": 1, "top_k": 1,
                   "top_p": 1.0, "temperature": 1.0}})


def synthetic_engine_manifest(root, *, adapter: dict | None = None, adapter_kind="identity",
                              model_files=("model.onnx",), export: dict | None = None) -> dict:
    """A complete engine manifest for a synthetic engine folder ``root`` (a placeholder
    graph, a real tokenizer, ``genai_config.json``): 1 layer, vocab 300, hashes of the files
    that are there. For loader tests that never run the graph; the graph and the
    genai_config.json should be :func:`synthetic_onnx_graph` (naming the listed data files)
    and :func:`synthetic_genai_config`, which the loader checks."""
    from calm_runtime.files import sha256_file
    from calm_runtime.formats.engine import engine_io_names

    inputs, outputs = engine_io_names(1)
    return {
        "schema_version": 1, "kind": "onnx", "created_by": "calm-export test",
        "created_at": "2026-01-01T00:00:00+00:00",
        "source": {"model": {"name": "tiny", "vocab_size": 300, "tokenizer_sha256": None,
                             "weights_sha256": None}, "adapter": adapter},
        "calibration": {"fused": True, "temperature": 1.3, "answer_temperature": 0.9,
                        "tau_min": 0.5, "tau_max": 2.0, "shift_min": -1.0, "shift_max": 1.0,
                        "adapter_kind": adapter_kind},
        "model": {"file": "model.onnx",
                  "files": {name: sha256_file(root / name) for name in model_files},
                  "num_layers": 1, "num_attention_heads": 2, "num_kv_heads": 1, "head_dim": 4,
                  "hidden_size": 8, "vocab_size": 300, "max_position_embeddings": 64,
                  "dtype": "float32", "opset": 18, "bos_token_id": 1, "eos_token_ids": [2],
                  "pad_token_id": 3, "add_bos": True},
        "io": {"inputs": inputs, "outputs": outputs},
        "tokenizer": {"files": {name: sha256_file(root / name) for name in
                                ("tokenizer.json", "tokenizer_config.json",
                                 "chat_template.jinja")},
                      "chat_template": "chat_template.jinja"},
        "option_tokens": {"plain": {" A": 4}, "chat": {"A": 4}},
        "p_true_template": {"name": "kadavath", "template": "Q: {question} A: {answer}",
                            "true_token": " A", "false_token": " B", "description": ""},
        "export": {"genai_config": {"file": "genai_config.json",
                                    "sha256": sha256_file(root / "genai_config.json")},
                   **(export or {})},
        "validation": {"passed": True, "max_abs_diff": 1e-6, "tolerance": 1e-4,
                       "greedy_steps": 4, "greedy_match": True, "batch2_max_abs_diff": 1e-6},
    }


MC_WORDS = "red blue green cat dog sun moon water fire earth stone tree river cloud".split()


def write_mc_jsonl(path, n: int = 40, *, seed: int = 0, options=(4,)):
    """Write ``n`` random multiple-choice records (calm's JSONL format) to ``path``, record
    ``i`` with ``options[i % len(options)]`` options (4 each by default)."""
    import json

    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        k = options[i % len(options)]
        words = rng.choice(MC_WORDS, size=k, replace=False)
        lines.append(json.dumps({"question": f"which is {words[0]} number {i}?",
                                 "choices": [str(w) for w in words],
                                 "answer": int(rng.integers(0, k))}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def private_calm_cache(tmp_path_factory):
    """A CALM_CACHE of the module's own (use with ``pytestmark = usefixtures(...)``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CALM_CACHE", str(tmp_path_factory.mktemp("calm-cache")))
        yield


@pytest.fixture(scope="module")
def mc_file(tmp_path_factory):
    """A 40-record multiple-choice JSONL file (:func:`write_mc_jsonl`)."""
    return write_mc_jsonl(tmp_path_factory.mktemp("data") / "mc.jsonl")


@pytest.fixture(scope="module")
def mixed_mc_file(tmp_path_factory):
    """A 100-record multiple-choice JSONL file with 2 to 6 options per question, as ARC-Easy
    (3–5) and hand-made sets have."""
    return write_mc_jsonl(tmp_path_factory.mktemp("data") / "mixed.jsonl", n=100,
                          options=(2, 3, 5, 6, 4))


@pytest.fixture(scope="module")
def runtime_lm(runtime_engine):
    """The runtime engine loaded with calm_runtime (one thread)."""
    from calm_runtime.inference.lm import CalibratedLM

    lm = CalibratedLM.load(runtime_engine[2], threads=1)
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def runtime_engine_dir(runtime_engine):
    """The runtime engine's folder."""
    return runtime_engine[2]


@pytest.fixture(scope="module")
def runtime_served(runtime_engine, runtime_lm):
    """The base URL of ``calm serve`` on :func:`runtime_lm` (served as ``tiny``, at most 64
    new tokens a request)."""
    pytest.importorskip("fastapi")
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    config = ServeConfig(engine=str(runtime_engine[2]), model_name="tiny", threads=1,
                         max_tokens_limit=64)
    with serve_in_background(create_app(config, runtime_lm)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def runtime_openai(runtime_engine):
    """An ``openai`` client of ``calm serve`` on the runtime engine (served as ``tiny``)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from calm_runtime.server import ServeConfig, create_app
    from calm_runtime.server.background import serve_in_background

    config = ServeConfig(engine=str(runtime_engine[2]), model_name="tiny", threads=1)
    with serve_in_background(create_app(config)) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------- loopback HTTP
# A scripted HTTP server on loopback, for tests of calm's clients of OpenAI-compatible APIs:
# subclass JSONHandler, then ``with loopback_server(Handler) as url``.

class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass

    def send_json(self, code: int, payload, kind: str = "application/json") -> None:
        """Answer ``code`` with ``payload`` (an object as JSON, or bytes as they are)."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def json_body(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))


@contextlib.contextmanager
def loopback_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on a free loopback port; yields the API's base URL (``.../v1``)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


def stop_process(process, timeout: float = 60) -> None:
    """Terminate a server process the test started; kill it if it outlives ``timeout``."""
    import subprocess

    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def calm_serve_process(engine, *options: str, name: str = "served"):
    """A real ``calm serve`` process for ``engine`` on a free loopback port; yields
    ``(base_url, process)`` (``base_url`` ends in ``/v1``) and stops it afterwards."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "calm_runtime.cli.main", "-q", "serve", str(engine), "--port",
         str(port), "--threads", "1", "--model-name", name, *options],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "calm serve did not start"
                time.sleep(0.25)
        yield url + "/v1", proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ------------------------------------------------------------------ benchmark scripts
#: benchmarks/ is not a package: a test imports a script with that folder on sys.path
BENCHMARKS = os.path.join(os.path.dirname(_HERE), "benchmarks")


@contextlib.contextmanager
def _benchmark_scripts(*names: str):
    """``benchmarks/NAME.py`` for each name, imported (one module, or a dict of them by name
    when several are asked for); afterwards ``benchmarks/`` leaves ``sys.path`` and every
    script imported meanwhile (those the named ones import too) leaves ``sys.modules``, so
    the next test imports them afresh."""
    import importlib

    before = set(sys.modules)
    sys.path.insert(0, BENCHMARKS)
    try:
        modules = {name: importlib.import_module(name) for name in names}
        yield modules[names[0]] if len(names) == 1 else modules
    finally:
        sys.path.remove(BENCHMARKS)
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if os.path.dirname(os.path.realpath(origin)) == os.path.realpath(BENCHMARKS):
                sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def benchmark_scripts():
    """A context manager: ``with benchmark_scripts("engines") as engines: ...``."""
    return _benchmark_scripts
