"""The precisions an engine is built in (``--dtype``, ``--quantize``), as objects: what each
writes, how it is validated and what it builds from the validated fp32 graph. Nothing in the
export compares a precision's name; it asks its object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["FP16", "FP32", "INT4", "INT8", "PRECISIONS", "Precision"]


@dataclass(frozen=True)
class Precision:
    """One engine precision."""

    name: str
    #: the engine's ``model.dtype`` in its manifest (its inputs and KV cache)
    dtype: str = "float32"
    #: the tolerance it is validated against the reference with (ExportConfig.tolerance)
    tolerance: str = "fp32"
    #: integer weights: kept only if they keep the fp32 engine's top token often enough
    #: (``ExportConfig.<name>_min_agreement``), not compared with the reference's logits
    quantized: bool = False
    #: what to try when the quantised engine keeps too few top tokens
    advice: str = ""
    #: onnxruntime-genai's builder precision (``-p``) that builds this engine directly from
    #: weights loaded in ``load_dtype`` (``None``: built from the validated fp32 graph)
    builder: str | None = None
    #: the torch dtype the weights are loaded in when the builder builds it directly
    load_dtype: str = "float32"

    @property
    def variant(self) -> bool:
        """Built from the validated fp32 graph (quantised or converted) where the graph is
        calm's own; see :attr:`builder` for the builder's graph."""
        return self.name != "fp32"

    def min_agreement(self, config) -> float:
        """The share of the fp32 engine's top tokens a quantised engine must keep."""
        return getattr(config, f"{self.name}_min_agreement")

    def build(self, source: Path, target: Path, config, *, external: bool,
              gguf_spec=None) -> dict:
        """The variant of the fp32 graph ``source`` in ``target``; the facts for the manifest."""
        raise NotImplementedError(f"{self.name} is the exported graph itself")

    def __str__(self) -> str:
        return self.name


class _Fp16(Precision):
    def build(self, source, target, config, *, external, gguf_spec=None) -> dict:
        from .quantize import convert_fp16

        return convert_fp16(source, target, external=external)


class _Int8(Precision):
    def build(self, source, target, config, *, external, gguf_spec=None) -> dict:
        from .quantize import quantize_int8

        return quantize_int8(source, target, config, external=external)


class _Int4(Precision):
    def build(self, source, target, config, *, external, gguf_spec=None) -> dict:
        from .quantize import quantize_int4

        return quantize_int4(source, target, config, external=external, gguf_spec=gguf_spec)


FP32 = Precision("fp32", builder="fp32")
#: the builder writes fp16 weights, activations and KV cache from a float16 model (no
#: float32 graph in between); calm's own graph converts its validated fp32 graph
FP16 = _Fp16("fp16", dtype="float16", tolerance="fp16", builder="fp16", load_dtype="float16")
INT8 = _Int8("int8", quantized=True, advice=(
    "keep more modules in fp32 (--int8-exclude), use --int8-scheme blockwise "
    "(ExportConfig.int8_block_size for a smaller block), or export fp32"))
INT4 = _Int4("int4", quantized=True, advice=(
    "use --quantize int8 or export fp32 (ExportConfig.int4_block_size for a smaller block)"))
PRECISIONS = {p.name: p for p in (FP32, FP16, INT8, INT4)}
