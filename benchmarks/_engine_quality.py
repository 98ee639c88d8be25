"""What each engine's precision costs, for benchmarks/engines.py: every engine read at the
same positions (top-1 agreement and total variation against calm fp32) and on the same
questions (``calm score``'s accuracy, ECE and NLL, cloze).

Besides the engines engines.py builds, three are derived here from them:

* ``calm int4 fp32 compute``: the int4 engine with MatMulNBits' accuracy level 0 (weights
  dequantised, fp32 arithmetic) instead of 4 (int8 activations);
* ``calm int4 requantised, head fp32``: every MatMul but the LM head quantised anew to 4 bits
  from the fp32 graph (``calm_export.quantize``), the head kept fp32;
* ``builder int4``: onnxruntime-genai's own int4 graph with calm fp32's manifest, tokenizer
  and genai_config (same inputs and outputs; without ``logits_to_keep``, which the runtime
  then does not feed) so that calm's runtime reads it like the others.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from calm_export.quantize import DRIFT_PROMPTS

#: the drift prompts of calm-export (plain text, code, a list) and two scoring prompts
PROMPTS = (*DRIFT_PROMPTS,
           "Question: What gas do plants absorb from the air?\nAnswer:",
           "Question: Which planet is closest to the sun?\nA. Venus\nB. Mercury\nC. Mars\n"
           "D. Earth\nAnswer:")
REFERENCE = "calm fp32"


def _copy_without_graph(engine: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(engine, target, ignore=shutil.ignore_patterns("model.onnx*"))


def _rehash(engine: Path) -> None:
    """Record the derived graph's files in the copied manifest (``model.files``), so the
    engine loads with its hashes checked like any other."""
    import hashlib
    import json

    path = engine / "calm_engine.json"
    manifest = json.loads(path.read_text())
    files = {}
    for name in sorted(p.name for p in engine.glob("model.onnx*")):
        digest = hashlib.sha256()
        with open(engine / name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        files[name] = digest.hexdigest()
    manifest["model"]["files"] = files
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def derive(builds: dict, work: Path) -> dict:
    """The derived engines (module docstring) as ``{name: folder}``, made once in ``work``."""
    import onnx

    from calm_export import ExportConfig, quantize

    out = {}
    int4 = Path(builds["calm int4"]["path"])
    target = work / "calm-int4-fp32-compute"
    if not target.is_dir():
        _copy_without_graph(int4, target)
        for data in int4.glob("model.onnx.data"):
            shutil.copy2(data, target / data.name)
        model = onnx.load(str(int4 / "model.onnx"), load_external_data=False)
        for node in model.graph.node:
            for attribute in node.attribute:
                if node.op_type == "MatMulNBits" and attribute.name == "accuracy_level":
                    attribute.i = 0
        onnx.save_model(model, str(target / "model.onnx"))
        _rehash(target)
    out["calm int4 fp32 compute"] = target

    fp32 = Path(builds[REFERENCE]["path"])
    target = work / "calm-int4-requantised-head-fp32"
    if not target.is_dir():
        _copy_without_graph(fp32, target)
        graph = onnx.load(str(fp32 / "model.onnx"), load_external_data=False)
        head = [name for name, path in quantize.linear_nodes(graph) if path == "lm_head"
                or name.startswith("/lm_head/")]
        quantize.quantize_int8(fp32 / "model.onnx", target / "model.onnx",
                               ExportConfig(quantize="int4"), external=True, bits=4, keep=head)
        _rehash(target)
    out["calm int4 requantised, head fp32"] = target

    if "builder int4" in builds:
        target = work / "builder-int4-as-calm-engine"
        if not target.is_dir():
            _copy_without_graph(fp32, target)
            source = Path(builds["builder int4"]["path"])
            for path in source.glob("model.onnx*"):
                shutil.copy2(path, target / path.name)
            _rehash(target)
        out["builder int4"] = target
    return out


def prompt_logits(lm, prompt: str) -> np.ndarray:
    """The engine's logits at every position of ``prompt`` (one prefill, no KV cache)."""
    ids = lm.tokenizer.encode(prompt)
    batch = np.asarray([ids], dtype=np.int64)
    logits, _ = lm.backend.run(batch, np.ones_like(batch),
                               np.arange(len(ids), dtype=np.int64)[None], None)
    return np.asarray(logits[0], dtype=np.float64)


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def quality(engines: dict[str, Path], data: str) -> dict:
    """``{name: {accuracy, ece, nll, brier, n, top1_agreement, mean_total_variation,
    positions}}`` for every engine, against ``engines[REFERENCE]``."""
    from calm_runtime.data.sets import load_dataset
    from calm_runtime.inference.lm import CalibratedLM
    from calm_runtime.measure.score import score_records

    records = load_dataset(data)
    base, out = None, {}
    for name in [REFERENCE, *(n for n in engines if n != REFERENCE)]:
        lm = CalibratedLM.load(engines[name], threads=2, verify_hashes=False)
        logits = [prompt_logits(lm, p) for p in PROMPTS]
        base = logits if name == REFERENCE else base
        agree = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, base,
                                                                              strict=True)])
        tv = np.concatenate([0.5 * np.abs(softmax(a) - softmax(b)).sum(-1)
                             for a, b in zip(logits, base, strict=True)])
        metrics = score_records(lm, records, mode="cloze")["metrics"]
        lm.close()
        out[name] = {"accuracy": metrics["accuracy"], "ece": metrics["ece"],
                     "nll": metrics["nll"], "brier": metrics["brier"], "n": metrics["n"],
                     "top1_agreement": float(agree.mean()),
                     "mean_total_variation": float(tv.mean()), "positions": int(agree.size)}
        print(f"{name} on {data}: accuracy {metrics['accuracy']:.3f}, ECE {metrics['ece']:.3f}, "
              f"top-1 agreement {agree.mean():.3f}", flush=True)
    return out
