"""Run onnxruntime-genai's model builder on a folder
(``python -m calm_export.graphs.genai_build``).

    python -m calm_export.graphs.genai_build SOURCE OUTPUT CACHE [PRECISION] [KEY=VALUE ...]

Builds the CPU graph (PRECISION fp32 by default, or int4, ...) of the transformers folder
SOURCE into OUTPUT, as ``python -m onnxruntime_genai.models.builder`` would. calm-export calls
:func:`main` in its own process (its prints go to a log); the benchmarks run this module to
build the builder's own arms.

The builder's Python API is internal and changes between releases: :func:`main` calls
``parse_extra_options`` with the 7-argument signature of 0.15 and later, reads the
``hf_details`` it returns and passes ``windowed_kv_cache``, which older builders do not know.
So calm drives only the releases it is tested with, :data:`BUILDER_VERSIONS` (the ``genai``
extra of pyproject.toml pins the same range); :func:`version_problem` says why another one is
not used, and calm-export's ``--graph auto`` then takes calm's own graph
(export/graphs/genai_builder.py).

One adjustment is made to the config the builder reads, where that builder still needs it
(:func:`rope_needs_flattening`): transformers 5 nests Gemma-3's rotary settings per layer
type (``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``) and no
longer sets ``rope_local_base_freq``, while the builder's Gemma-3 class reads the flat form
(its rotary reader takes ``rope_parameters["rope_type"]``: KeyError 'rope_type'); the global
settings become the top-level ones and the local theta ``rope_local_base_freq``, which is
what its Gemma-3 code reads.
"""

from __future__ import annotations

import re
import sys

#: The onnxruntime-genai releases whose model builder calm drives: ``[low, high)``. The low
#: end is the release this module is tested with (0.18.0); the builder's internal API has
#: changed between minor releases, so the next minor release is outside until it is tested.
#: pyproject.toml's ``genai`` extra pins the same range (a test checks that they agree).
BUILDER_VERSIONS = ("0.18", "0.19")

#: The builder's class (``onnxruntime_genai.models.builders``) for each architecture among
#: calm's builder families whose transformers config nests the rotary settings per layer type.
_NESTED_ROPE_CLASSES = {"Gemma3ForCausalLM": "Gemma3Model"}


class BuilderVersionError(RuntimeError):
    """The installed onnxruntime-genai is outside :data:`BUILDER_VERSIONS`."""


def builder_range() -> str:
    """:data:`BUILDER_VERSIONS` as a version specifier, ``">=0.18,<0.19"``."""
    low, high = BUILDER_VERSIONS
    return f">={low},<{high}"


def installed_version() -> str | None:
    """The installed onnxruntime-genai's version (the module's ``__version__``, whichever
    distribution provides it: -cuda, -directml, ...), or ``None`` when none is installed."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return None
    try:
        import onnxruntime_genai
    except Exception:  # noqa: BLE001 - a broken install: its metadata may still say which
        import importlib.metadata

        try:
            return importlib.metadata.version("onnxruntime-genai")
        except importlib.metadata.PackageNotFoundError:
            return "unknown"
    return str(getattr(onnxruntime_genai, "__version__", "unknown"))


def _release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, micro)`` of a version string (``"0.18.0rc1"``: ``(0, 18, 0)``)."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    return None if match is None else (int(match[1]), int(match[2]), int(match[3] or 0))


def version_problem(version: str | None = None) -> str | None:
    """Why calm does not drive the onnxruntime-genai builder of ``version`` (default: the
    installed one), in one line naming the version and the tested range; ``None`` when it
    does, or when none is installed (genai_builder.not_built_because says that)."""
    if version is None:
        version = installed_version()
        if version is None:
            return None
    low, high = (_release(v) for v in BUILDER_VERSIONS)
    release = _release(version)
    if release is not None and low <= release < high:
        return None
    return (f"onnxruntime-genai {version} is installed, but calm drives its model builder only "
            f"within the tested range {builder_range()} (pip install "
            f"'onnxruntime-genai{builder_range()}')")


def check_version() -> None:
    """Raise :class:`BuilderVersionError` (one line) when the installed builder is outside
    :data:`BUILDER_VERSIONS`."""
    problem = version_problem()
    if problem is not None:
        raise BuilderVersionError(problem)


def _nested_rope(config) -> bool:
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and "rope_type" not in params and "full_attention" in params


def rope_needs_flattening(config, builders=None) -> bool:
    """Whether the builder must be handed flat rotary settings for ``config``: the config
    nests them per layer type, and the builder's class for the model still reads the flat
    form, i.e. it inherits the base reader ``Model.make_rope_init`` (which reads
    ``rope_parameters["rope_type"]``) instead of overriding it as 0.18's ``Gemma4Model``
    does for its own nested settings. 0.18's ``Gemma3Model`` inherits it and reads
    ``config.rope_local_base_freq``. ``builders``: ``onnxruntime_genai.models.builders``
    (tests pass another); a nested config whose class is not known is flattened."""
    if not _nested_rope(config):
        return False
    if builders is None:
        from onnxruntime_genai.models import builders
    architecture = (getattr(config, "architectures", None) or [None])[0]
    name = _NESTED_ROPE_CLASSES.get(architecture)
    cls, base = getattr(builders, name or "", None), getattr(builders, "Model", None)
    if cls is None or base is None:
        return True
    return getattr(cls, "make_rope_init", None) is getattr(base, "make_rope_init", None)


def _flatten_rope(config) -> None:
    params = getattr(config, "rope_parameters", None)
    if _nested_rope(config):
        config.rope_parameters = dict(params["full_attention"])
        local = params.get("sliding_attention") or params["full_attention"]
        config.rope_local_base_freq = local["rope_theta"]


def main(argv: list[str]) -> int:
    check_version()
    from onnxruntime_genai.models import builder

    source, output, cache, *extra = argv
    precision = extra.pop(0) if extra and "=" not in extra[0] else "fp32"
    options = builder.parse_extra_options(None, source, output, precision, "cpu", cache, extra)
    config = options["hf_details"]["hf_config"]
    if rope_needs_flattening(config):
        _flatten_rope(config)
    builder.create_model(None, source, output, precision, "cpu", cache, **options)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BuilderVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
