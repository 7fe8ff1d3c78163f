"""Model runner: owns the weights and the KV cache, turns a schedule into logits.

It knows nothing of queues or policy: it gets the scheduled chunks and block copies and
returns the logits rows that need sampling (plus per-position prompt logits for requests
that asked for prompt logprobs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from plait.engine.config import EngineConfig
from plait.engine.model_config import ModelConfig
from plait.engine.model_loader import ResolvedModel
from plait.engine.models.llama import AttentionMetadata, LlamaForCausalLM, prepack_cpu_linears
from plait.engine.scheduler import ScheduledChunk, SchedulerOutput
from plait.engine.transfer import to_device
from plait.engine.weights import load_weights

logger = logging.getLogger("plait.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[requested]


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor  # [num_sample_rows, vocab] float32, one row per sampling chunk
    row_of: dict[int, int] = field(default_factory=dict)  # id(request) -> row in `logits`
    # id(request) -> [num_tokens, vocab] logits of each computed prompt position
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    """Builds the model on `device` and a KV cache sized from `config`."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel,
                 model: LlamaForCausalLM | None = None) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config: ModelConfig = resolved.config
        self.block_size = config.block_size
        max_pos = config.max_model_len or resolved.config.max_position_embeddings
        if model is None:
            model = self._load_model(resolved, max_pos)
        self.model = model.eval()
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory(config)
        self.max_model_len = min(max_pos, self.num_blocks * self.block_size)
        cfg = self.model_config
        # kv_cache: [layers, 2 (k|v), num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size,
                                    cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype,
                                    device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]

    def _load_model(self, resolved: ResolvedModel, max_pos: int) -> LlamaForCausalLM:
        with torch.device(self.device):
            model = LlamaForCausalLM(resolved.config, max_pos)
        load_weights(model, resolved.path)
        model = model.to(self.dtype)
        if self.device.type == "cpu":
            prepack_cpu_linears(model)
        return model

    def _block_bytes(self) -> int:
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return cfg.num_layers * 2 * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _blocks_from_memory(self, config: EngineConfig) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = 2 << 30  # activations, logits and the allocator's slack
            budget = total * config.gpu_memory_utilization - (total - free) - reserve
        else:
            budget = config.kv_cache_memory_gb * (1 << 30)
        num = int(budget // self._block_bytes())
        if num < 2:
            raise ValueError("not enough memory for the KV cache; lower the model size or "
                             "raise --gpu-memory-utilization / --kv-cache-memory-gb")
        return num

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply block copies, run the forward pass over `out.chunks`, return logits."""
        if out.block_copies:
            src = self.to_device([s for s, _ in out.block_copies], torch.int64)
            dst = self.to_device([d for _, d in out.block_copies], torch.int64)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if not out.chunks:
            return RunnerOutput(torch.empty(0, self.model_config.vocab_size, device=self.device))
        input_ids, positions, meta, sample_idx = self._prepare(out.chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        result = RunnerOutput(self.model.compute_logits(hidden[sample_idx]))
        rows = [c for c in out.chunks if c.sample]
        result.row_of = {id(c.request): i for i, c in enumerate(rows)}
        offset = 0
        for chunk in out.chunks:
            req = chunk.request
            if req.needs_prompt_logprobs and chunk.start < req.num_prompt_tokens:
                span = hidden[offset : offset + chunk.num_tokens]
                result.prompt_logits[id(chunk.request)] = self.model.compute_logits(span)
            offset += chunk.num_tokens
        return result

    def _prepare(self, chunks: list[ScheduledChunk]):
        """Flatten the chunks into the model's inputs (see models/llama.py)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        sample_idx: list[int] = []
        max_blocks = max(len(c.request.block_ids) for c in chunks)
        tables = []
        for chunk in chunks:
            req, end = chunk.request, chunk.start + chunk.num_tokens
            input_ids.extend(req.token_ids(chunk.start, end))
            span = range(chunk.start, end)
            positions.extend(span)
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
            context_lens.append(end)
            if chunk.sample:
                sample_idx.append(cu_seqlens[-1] - 1)
            tables.append(table + [-1] * (max_blocks - len(table)))
        meta = AttentionMetadata(
            slot_mapping=self.to_device(slots, torch.int64),
            cu_seqlens_q=self.to_device(cu_seqlens, torch.int32),
            context_lens=self.to_device(context_lens, torch.int32),
            block_tables=self.to_device(tables, torch.int32),
            max_query_len=max(c.num_tokens for c in chunks),
            max_context_len=max(context_lens),
        )
        return (self.to_device(input_ids, torch.int64), self.to_device(positions, torch.int64),
                meta, self.to_device(sample_idx, torch.int64))

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor, without waiting for the GPU (see transfer.py)."""
        return to_device(values, self.device, dtype)
