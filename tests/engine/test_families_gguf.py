"""Each family's GGUF, as llama.cpp's own converter writes it (helpers/gguf_convert.py, F32
and Q8_0, and Q4_K requantized from the F32 file by helpers/q4k.py), through the engine
against transformers on the same weights: greedy tokens and their logprobs.

F32 files hold the checkpoint's own values (Gemma's norms as 1 + w, exact in float32), so
the reference is transformers on the checkpoint itself: this checks the config read from
the file's keys (gguf_config.py) and the tensor mapping (gguf_weights.py) independently.
Q8_0 and Q4_K files hold quantized weights; the reference is transformers on those weights
dequantized (the file's blocks decoded by Plait's loader with `keep=False` and copied back
under transformers' names, Gemma's norms minus 1), so the one difference left is the order
of float32 additions in the kept Q8_0 / Q4_K products: the same tight tolerance applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.engine import prompt
from helpers.families import families_cache, tiny_family_checkpoint
from helpers.gguf_convert import family_gguf
from helpers.hf_greedy import assert_greedy_matches, hf_greedy, hf_model

from plait import LLM
from plait.engine.gguf_weights import load_gguf_weights
from plait.engine.model_config import ModelConfig
from plait.engine.model_loader import resolve_model
from plait.engine.models.llama import LlamaForCausalLM
from plait.kernels import AttentionShape, TorchOps
from plait.kernels.cpu import build

pytestmark = pytest.mark.usefixtures("one_torch_thread", "conversion_cache")

FAMILIES = ("qwen3", "gemma3", "gemma2", "phi3", "granite", "smollm3", "olmo2")
NUM_TOKENS = 16
LOGPROB_ATOL = 2e-4
# Phi-3's longrope takes its short factors up to original_max_position_embeddings (1024 in
# the fixture): an engine context of at most that many positions, as transformers does for
# sequences of at most that length (models/rope.py)
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def conversion_cache(tmp_path_factory):
    """A fresh $PLAIT_CACHE for the engine's conversions of this module's GGUF files (so
    none is stale), the native kernels loaded from the usual cache first (not rebuilt in
    the fresh one), and the fixtures' own cache (checkpoints, llama.cpp's tree, the
    converted files) shared with the other tests through a link: converted once a run."""
    build.library()
    fresh = tmp_path_factory.mktemp("cache")
    shared = families_cache()
    shared.mkdir(parents=True, exist_ok=True)
    (fresh / shared.name).symlink_to(shared, target_is_directory=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAIT_CACHE", str(fresh))
        yield


def _dequantized_reference(ckpt: Path, gguf: Path):
    """transformers' model of `ckpt` with every weight replaced by the GGUF's, dequantized."""
    resolved = resolve_model(str(gguf), float32_weights=False)
    cfg = resolved.config
    ours = LlamaForCausalLM(cfg, 64, TorchOps(AttentionShape(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 4)))
    load_gguf_weights(ours, gguf, keep=False)
    hf = hf_model(ckpt)
    state = {name: _plait_tensor(ours, cfg, name) for name in hf.state_dict()}
    hf.load_state_dict(state)
    return hf


def _plait_tensor(model: LlamaForCausalLM, cfg: ModelConfig, hf_name: str) -> torch.Tensor:
    """The tensor of Plait's loaded model that transformers names `hf_name`."""
    ours = dict(model.named_parameters())
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and name not in ours:
        name = "embed_tokens.weight"
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for part, (fused, rows) in {
        "q_proj": ("qkv_proj", (0, q)), "k_proj": ("qkv_proj", (q, q + kv)),
        "v_proj": ("qkv_proj", (q + kv, q + 2 * kv)),
        "gate_proj": ("gate_up_proj", (0, cfg.intermediate_size)),
        "up_proj": ("gate_up_proj", (cfg.intermediate_size, 2 * cfg.intermediate_size)),
    }.items():
        if f".{part}." in name:
            return ours[name.replace(part, fused)][rows[0]:rows[1]].detach().clone()
    tensor = ours[name].detach().clone()
    if cfg.norm_offset and "norm" in name:
        tensor = tensor - 1.0  # the file's 1 + w back to Gemma's w
    return tensor


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_k"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_greedy_matches_transformers(family, outtype) -> None:
    """Both weight modes: the file's format kept (`--weights auto`, native kernels) and
    dequantized to float32 at load (`--weights float32`). The prompts are longer than the
    Gemma fixtures' 16-token window once generation starts."""
    ckpt, gguf = tiny_family_checkpoint(family), family_gguf(family, outtype)
    hf = hf_model(ckpt) if outtype == "f32" else _dequantized_reference(ckpt, gguf)
    vocab = hf.config.vocab_size
    prompts = [[3 + t % (vocab - 3) for t in prompt(seed, 21)] for seed in (1, 2)]
    refs = [hf_greedy(hf, ids, NUM_TOKENS) for ids in prompts]
    for weights in ("auto", "float32"):
        llm = LLM(str(gguf), num_kv_blocks=64, block_size=4, weights=weights,
                  max_model_len=MAX_MODEL_LEN, numerics="exact")
        assert llm.engine.runner.model_config.model_type == hf.config.model_type
        for ids, ref in zip(prompts, refs, strict=True):
            assert_greedy_matches(llm, ids, ref, LOGPROB_ATOL, weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_checkpoint_directory_matches_transformers(family) -> None:
    """The same fixture checkpoints as Hugging Face directories (their own tokenizers:
    SentencePiece for gemma and phi3)."""
    ckpt = tiny_family_checkpoint(family)
    hf = hf_model(ckpt)
    llm = LLM(str(ckpt), num_kv_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN)
    ids = [3 + t % (hf.config.vocab_size - 3) for t in prompt(3, 25)]
    assert_greedy_matches(llm, ids, hf_greedy(hf, ids, NUM_TOKENS), LOGPROB_ATOL)
