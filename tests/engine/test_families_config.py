"""Reading each family's config.json (hf_families.py), and the RoPE scalings (rope.py)
against transformers' own frequency functions."""

from __future__ import annotations

import json
import math

import pytest
import torch

from plait.engine.model_config import ModelConfig, ModelLoadError
from plait.engine.model_loader import resolve_model
from plait.engine.models.rope import rope_cos_sin

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=12,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def test_unsupported_architecture_names_it_and_lists_the_supported(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "falcon"}))
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(tmp_path))
    message = str(err.value)
    assert message.startswith("unsupported architecture 'falcon'; supported: llama, mistral, "
                              "qwen2, qwen3, gemma2, gemma3_text, phi3, granite, smollm3, "
                              "olmo2")
    assert "\n" not in message


def test_gemma3_config_of_the_older_format() -> None:
    """rope_theta + rope_local_base_freq + rope_scaling and sliding_window_pattern at the top
    level (the format of the Hub's files), no layer_types."""
    cfg = ModelConfig.from_dict({
        **BASE, "model_type": "gemma3_text", "head_dim": 32, "query_pre_attn_scalar": 48,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "final_logit_softcapping": None, "hidden_activation": "gelu_pytorch_tanh"})
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert [cfg.window_of(i) for i in (4, 5, 11)] == [512, 0, 0]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.attention_scale == 48**-0.5 and cfg.final_softcap == 0.0
    assert cfg.embedding_scale == 8.0 and cfg.norm_offset and cfg.qk_norm == "head"
    assert cfg.hidden_act == "gelu_tanh" and cfg.norm_layout == "sandwich"
    assert not cfg.is_plain


def test_phi3_su_is_longrope_with_its_ratio_as_factor() -> None:
    cfg = ModelConfig.from_dict({
        **BASE, "model_type": "phi3", "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 1024, "sliding_window": 2047,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}})
    assert cfg.rotary_dim == 12 and cfg.sliding_layers == tuple(range(12))
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "longrope"
    assert cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 1024
    with pytest.raises(ModelLoadError, match="short_factor has 5 values, expected 6"):
        ModelConfig.from_dict({**BASE, "model_type": "phi3", "partial_rotary_factor": 0.75,
                               "original_max_position_embeddings": 1024, "rope_scaling": {
                                   "type": "su", "short_factor": [1.0] * 5,
                                   "long_factor": [2.0] * 6}})


def test_llama_shape_families_stay_plain_and_variants_do_not() -> None:
    qwen2 = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}})
    assert qwen2.is_plain and qwen2.attention_bias
    assert qwen2.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 1024}
    smollm3 = ModelConfig.from_dict({**BASE, "model_type": "smollm3"})
    assert smollm3.nope_layers == (3, 7, 11) and smollm3.rope_theta == 2e6
    assert ModelConfig.from_dict({**BASE, "model_type": "olmo2"}).norm_layout == "post"
    qwen3 = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 128,
                                   "use_sliding_window": False, "sliding_window": 4096,
                                   "layer_types": ["sliding_attention"] * 12})
    assert qwen3.head_dim == 128 and qwen3.sliding_layers == () and qwen3.qk_norm == "head"
    with pytest.raises(ModelLoadError, match="unsupported rope_type 'dynamic'"):
        ModelConfig.from_dict({**BASE, "model_type": "llama",
                               "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def _hf_table(rope_parameters: dict, seq_len: int, positions: int, rotary: int,
              **config) -> torch.Tensor:  # [positions, rotary]
    """transformers' cos | sin for `rope_parameters` (its ROPE_INIT_FUNCTIONS)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # Phi3Config turns "yarn" into longrope, so the others go through Qwen2's
    model_type = "phi3" if rope_parameters["rope_type"] == "longrope" else "qwen2"
    hf = AutoConfig.for_model(model_type, **{**BASE, "rope_parameters": rope_parameters,
                                         "partial_rotary_factor": rotary / 16, **config})
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](
        hf, "cpu", seq_len=seq_len)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], -1) * attention


@pytest.mark.parametrize("rope_parameters", [
    dict(rope_type="linear", factor=8.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256),
    dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=512, beta_fast=16,
         beta_slow=2, attention_factor=1.25),
], ids=["linear", "yarn", "yarn-options"])
def test_rope_scalings_equal_transformers(rope_parameters) -> None:
    params = {**rope_parameters, "rope_theta": 10000.0}
    ours = rope_cos_sin(16, 2048, 10000.0, rope_parameters)
    ref = _hf_table(params, 2048, 2048, 16)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)  # float32 angles up to 2047


@pytest.mark.parametrize("context", [512, 4096], ids=["short", "long"])
def test_longrope_takes_the_long_factors_beyond_the_original_context(context) -> None:
    """Plait's table for a context of `context` positions equals transformers' table for a
    sequence of that length: the short factors up to original_max_position_embeddings
    (1024), the long ones beyond; the attention factor sqrt(1 + ln 4 / ln 1024) on both."""
    scaling = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.4, 2.0, 2.2, 3.0],
                   long_factor=[1.5, 2.5, 4.0, 6.0, 9.0, 12.0],
                   original_max_position_embeddings=1024, factor=4.0)
    ours = rope_cos_sin(12, context, 10000.0, scaling)
    ref = _hf_table({**scaling, "rope_theta": 10000.0}, context, context, 12,
                    original_max_position_embeddings=1024)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
    assert ours[0, 0].item() == pytest.approx(math.sqrt(1 + math.log(4) / math.log(1024)))


def _gguf(arch: str, keys: dict, tensors: tuple[str, ...] = (),
          factors: dict | None = None):
    """A GgufFile of metadata `keys` (under `arch.`) and stand-in tensors: token_embd
    [64, 100] (GGUF order), `tensors` named, phi3's factor tensors from `factors`."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from plait.engine.gguf_file import GgufFile, GgufTensor

    f32 = GGMLQuantizationType.F32
    found = {name: GgufTensor(name, f32, (64, 64), np.zeros((64, 256), np.uint8))
             for name in ("token_embd.weight", *tensors)}
    found["token_embd.weight"] = GgufTensor("token_embd.weight", f32, (64, 100),
                                            np.zeros((100, 256), np.uint8))
    for name, values in (factors or {}).items():
        data = np.array(values, np.float32).view(np.uint8)
        found[name] = GgufTensor(name, f32, (len(values),), data)
    meta = {"general.architecture": arch, "tokenizer.ggml.eos_token_id": 2,
            **{f"{arch}.{k}": v for k, v in keys.items()}}
    return GgufFile(arch, found, meta)


GGUF_BASE = {"embedding_length": 64, "feed_forward_length": 128, "block_count": 46,
             "attention.head_count": 4, "attention.head_count_kv": 2,
             "context_length": 4096}


def test_gguf_gemma2_27b_scale_and_windows_follow_llama_cpp() -> None:
    """No query_pre_attn_scalar key: 1 / sqrt(hidden / heads) for the 27B's 46 layers
    (here 64 / 4 = 16 while key_length is 32), else 1 / sqrt(head_dim); gemma2 windows
    alternate from layer 0; the file's softcaps."""
    from plait.engine.gguf_config import hf_config_from_gguf

    keys = {**GGUF_BASE, "attention.key_length": 32, "attention.sliding_window": 128,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    cfg = ModelConfig.from_dict(hf_config_from_gguf(_gguf("gemma2", keys)))
    assert cfg.attention_scale == 16**-0.5 and cfg.head_dim == 32
    assert cfg.sliding_layers == tuple(range(0, 46, 2)) and cfg.sliding_window == 128
    assert (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 100
    smaller = ModelConfig.from_dict(hf_config_from_gguf(_gguf("gemma2", {
        **keys, "block_count": 26})))
    assert smaller.attention_scale == 32**-0.5


def test_gguf_gemma3_pattern_array_and_local_base() -> None:
    from plait.engine.gguf_config import hf_config_from_gguf

    keys = {**GGUF_BASE, "block_count": 4, "attention.sliding_window": 64,
            "attention.sliding_window_pattern": (True, False, True, True),
            "rope.freq_base": 1e6, "rope.freq_base_swa": 5e4,
            "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    cfg = ModelConfig.from_dict(hf_config_from_gguf(_gguf("gemma3", keys)))
    assert cfg.sliding_layers == (0, 2, 3) and cfg.local_rope_theta == 5e4
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    no_window = ModelConfig.from_dict(hf_config_from_gguf(_gguf("gemma3", {
        **keys, "attention.sliding_window": 0})))
    assert no_window.sliding_layers == ()


def test_gguf_phi3_longrope_from_its_factor_tensors() -> None:
    from plait.engine.gguf_config import hf_config_from_gguf

    keys = {**GGUF_BASE, "block_count": 2, "rope.dimension_count": 8,
            "rope.scaling.original_context_length": 1024, "attention.sliding_window": 0}
    factors = {"rope_factors_long.weight": [1.0, 2.0, 3.0, 4.0],
               "rope_factors_short.weight": [1.0, 1.5, 1.75, 2.0]}
    cfg = ModelConfig.from_dict(hf_config_from_gguf(_gguf("phi3", keys, factors=factors)))
    assert cfg.rotary_dim == 8 and cfg.sliding_layers == ()
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["long_factor"] == [1.0, 2.0, 3.0, 4.0]
    assert cfg.rope_scaling["short_factor"] == [1.0, 1.5, 1.75, 2.0]
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(1024)))
    plain = ModelConfig.from_dict(hf_config_from_gguf(_gguf("phi3", keys)))
    assert plain.rope_scaling is None


def test_gguf_granite_scales_and_unsupported_architectures() -> None:
    from plait.engine.gguf_config import hf_config_from_gguf

    keys = {**GGUF_BASE, "embedding_scale": 12.0, "residual_scale": 0.22,
            "attention.scale": 0.015625, "logit_scale": 8.0}
    cfg = ModelConfig.from_dict(hf_config_from_gguf(_gguf("granite", keys,
                                                          ("output.weight",))))
    assert (cfg.embedding_scale, cfg.residual_scale, cfg.attention_scale,
            cfg.logits_divisor) == (12.0, 0.22, 0.015625, 8.0)
    assert not cfg.tie_word_embeddings
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        hf_config_from_gguf(_gguf("falcon", keys))
    with pytest.raises(ModelLoadError, match="differs between layers"):
        hf_config_from_gguf(_gguf("qwen3", {**GGUF_BASE, "attention.head_count_kv": (2, 4)}))


def test_gguf_of_an_unsupported_architecture_is_one_line(tmp_path, monkeypatch) -> None:
    """resolve_model on a GGUF whose general.architecture Plait does not serve names it and
    lists the supported ones; nothing is left in the cache."""
    from gguf import GGUFWriter

    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "falcon.gguf"
    writer = GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(path))
    message = str(err.value)
    assert message.startswith("unsupported GGUF architecture 'falcon'; expected ")
    assert "a .gguf file (llama, qwen2, qwen3, gemma2, gemma3, phi3, granite, smollm3, " \
        "olmo2)" in message and "\n" not in message
    assert not any((tmp_path / "cache").glob("gguf-*"))
