"""Build a Llama model with an ops table, and drive it over a hand-written paged cache."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from plait.engine.model_config import ModelConfig
from plait.engine.models.linear import apply_products, resolve_cpu_gemm
from plait.engine.models.llama import LlamaForCausalLM
from plait.engine.weights import load_weights
from plait.kernels import AttentionMetadata, AttentionShape, TorchOps, select_ops
from plait.kernels.cpu.products import ProductSettings


def cpu_ops(cfg: ModelConfig, block_size: int, native: bool = True,
            cascade: bool = True) -> TorchOps:
    """The float32 CPU ops table the engine would choose with these settings."""
    shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size)
    return select_ops(torch.device("cpu"), torch.float32, shape, native_kernels=native,
                      cascade=cascade, cpu_gemm=resolve_cpu_gemm())


def load_model(path: Path, max_positions: int = 4096, block_size: int = 4,
               native: bool = True, cascade: bool = True,
               convert: bool = True) -> LlamaForCausalLM:
    """The model at `path` as the runner builds it on CPU in float32: its ops table, its
    weights, and (with `convert`) its linear layers on the product rows the runner picks
    for that table (without: the unselected "torch" row)."""
    cfg = ModelConfig.from_dir(path)
    ops = cpu_ops(cfg, block_size, native, cascade)
    model = LlamaForCausalLM(cfg, max_positions, ops)
    load_weights(model, path)
    if convert:
        select_rows(model)
    return model.eval()


def select_rows(model: LlamaForCausalLM) -> None:
    """Every linear of `model` on the rows the runner picks for its ops table in the
    default mode (float32 compute, no int8)."""
    apply_products(model, ProductSettings(model.ops.cpu_gemm, model.ops.native))


class PagedHarness:
    """A KV cache with hand-written block tables, to drive the model directly."""

    def __init__(self, cfg: ModelConfig, num_blocks: int = 64, block_size: int = 4,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
                   for _ in range(cfg.num_layers)]

    def run(self, model: LlamaForCausalLM,
            seqs: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """seqs: (all token ids so far, num already cached, block table). Returns the logits
        of every newly computed position, per sequence."""
        ids, positions, meta = self.step(seqs)
        hidden = self.forward(model, ids, positions, meta)
        logits = model.compute_logits(hidden)
        cu = meta.cu_seqlens_q.tolist()
        return [logits[a:b] for a, b in itertools.pairwise(cu)]

    def forward(self, model: LlamaForCausalLM, ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv: list | None = None,
                whole_stack: bool | None = None) -> torch.Tensor:
        """One forward on this cache (or on `kv`), the step planned by the model's ops
        table as the runner plans it; `whole_stack` overrides the plan's choice."""
        model.bind(self.kv if kv is None else kv)
        meta = model.ops.plan(meta, positions)
        if whole_stack is not None:
            meta.whole_stack = whole_stack
        with torch.inference_mode():
            return model(ids, positions, meta)

    def step(self, seqs: list[tuple[list[int], int, list[int]]],
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The input ids, positions and (unplanned) metadata of one forward over `seqs`."""
        bs = self.block_size
        ids, pos, slots, cu, ctx, tables = [], [], [], [0], [], []
        width = max(len(t) for _, _, t in seqs)
        for tokens, cached, table in seqs:
            span = range(cached, len(tokens))
            ids += tokens[cached:]
            pos += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            cu.append(cu[-1] + len(span))
            ctx.append(len(tokens))
            tables.append(table + [-1] * (width - len(table)))
        meta = AttentionMetadata(
            torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(b - a for a, b in itertools.pairwise(cu)),
            max_context_len=max(ctx))
        return torch.tensor(ids), torch.tensor(pos), meta


def transformers_on_gguf(path: Path):
    """transformers' model on a GGUF file, dequantized to float32 by its own GGUF loader
    (what `from_pretrained(gguf_file=...)` runs, without its accelerate requirement); for a
    directory, the model.safetensors that `convert_gguf` wrote with that same loader."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(loaded["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


def greedy_reference(path: Path, prompts: list[list[int]], eos: list[int],
                     num_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone (the model at `path`: a .gguf or
    its converted directory), EOS suppressed."""
    hf = transformers_on_gguf(path)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                              suppress_tokens=eos,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(out[0, len(ids):].tolist())
    return outs
