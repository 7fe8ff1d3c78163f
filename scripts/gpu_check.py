#!/usr/bin/env python3
"""Prepared GPU check: kernels on CUDA, logits parity, and benchmarks, in one run.

Needs only torch, triton and transformers (no fastapi/pydantic, no network). Sections:

  kernels     Triton attention / KV write, through the ops table a CUDA engine gets
              (`select_ops`: `TritonOps`), against the torch reference on CUDA shapes
  parity      Plait logits vs transformers on a random Llama (fp32 and bf16), the model
              built with the ops table the engine would pick (`ops` in the results)
  decode      Plait decode throughput at batch 1, 32, 128 vs transformers `generate`
  shared      n=100 shared-prefill workload (512-token prompt, max_tokens=1) vs generate
  bandwidth   decode attention kernel GB/s vs device copy GB/s, measured in the same run

Writes results.json and results.md into --out after every section, so a run cut short
still leaves the figures of the sections it finished. Every timed configuration is run once
untimed first, so Triton compilation and cuBLAS heuristics stay out of the figures.
`--tiny --device cpu` runs every section's code path on a tiny model on CPU (what the test
suite does), skipping the CUDA-only ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from plait import LLM, SamplingParams
from plait.engine.model_config import ModelConfig
from plait.engine.models.linear import apply_products, resolve_cpu_gemm
from plait.engine.models.llama import LlamaForCausalLM
from plait.engine.weights import load_weights
from plait.kernels import AttentionMetadata, AttentionShape, TorchOps, TritonOps, select_ops
from plait.kernels.cpu.products import ProductSettings

# ~1.1B parameters, Llama-shaped (GQA 32/8, SwiGLU, RoPE).
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def load_script(name: str):
    """A sibling script (scripts/<name>.py) as a module, imported from its path: scripts
    are not a package, and `python -P` (gpu_check.sh) puts no script folder on sys.path."""
    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"plait_scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_ops(device: str, dtype: torch.dtype, cfg: ModelConfig, block_size: int) -> TorchOps:
    """The ops table an engine with the default options gets on `device` (as
    `ModelRunner` chooses it)."""
    return select_ops(
        torch.device(device), dtype,
        AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size),
        cpu_gemm=resolve_cpu_gemm() if device == "cpu" else "none")


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer over `vocab_size` ids: no tokenizer files exist on the GPU box."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", eos_token="t1")


def build_model_dir(shape: dict, out: Path, device: str, dtype: torch.dtype):
    """Random-weight Llama checkpoint (+ synthetic tokenizer); returns the HF model too."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(**shape, rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = HFLlama(config)
    with torch.no_grad():
        for p in model.parameters():  # parameters only: RoPE's inv_freq buffer stays fp32,
            p.data = p.data.to(dtype)  # as in a checkpoint loaded with torch_dtype=bf16
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    synthetic_tokenizer(shape["vocab_size"]).save_pretrained(out)
    return model.eval()


def check_kernels(device: str) -> dict:
    """Triton kernels vs the reference on CUDA-sized shapes, bf16 and fp16, through the ops
    table a CUDA engine gets: new K/V for every query token written with `ops.write_kv`
    (bit for bit the reference's), then `ops.attention` over the written cache."""
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    from plait.kernels.reference import paged_attention_reference, write_kv_reference

    results = {}
    for dtype in (torch.bfloat16, torch.float16):
        for block_size, gqa in ((16, 4), (32, 8), (8, 1)):
            torch.manual_seed(0)
            num_kv, dim = 8, 128
            shape = AttentionShape(num_kv * gqa, num_kv, dim, block_size)
            ops = select_ops(torch.device("cuda"), dtype, shape)
            if not isinstance(ops, TritonOps):
                raise RuntimeError(f"select_ops chose {type(ops).__name__} on CUDA, "
                                   "not TritonOps (is triton importable?)")
            q_lens, ctx_lens = [1, 1, 37, 300, 1, 129], [1, 2050, 37, 812, 4000, 129]
            num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 8
            k_cache = torch.randn(num_blocks, block_size, num_kv, dim, device="cuda", dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            perm = torch.randperm(num_blocks, device="cuda")
            width = max(-(-c // block_size) for c in ctx_lens)
            tables, used, positions, slots = [], 0, [], []
            for n_q, c in zip(q_lens, ctx_lens, strict=True):
                n = -(-c // block_size)
                row = perm[used : used + n].tolist()
                used += n
                tables.append(row + [-1] * (width - n))
                for p in range(c - n_q, c):  # the query tokens' positions and slots
                    positions.append(p)
                    slots.append(row[p // block_size] * block_size + p % block_size)
            query = torch.randn(sum(q_lens), num_kv * gqa, dim, device="cuda", dtype=dtype)
            key = torch.randn(sum(q_lens), num_kv, dim, device="cuda", dtype=dtype)
            value = torch.randn_like(key)
            cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device="cuda",
                              dtype=torch.int32)
            meta = AttentionMetadata(
                torch.tensor(slots, device="cuda", dtype=torch.int64), cu,
                torch.tensor(ctx_lens, device="cuda", dtype=torch.int32),
                torch.tensor(tables, device="cuda", dtype=torch.int32), max(q_lens),
                max(ctx_lens))
            meta = ops.plan(meta, torch.tensor(positions, device="cuda"))
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            write_kv_reference(key, value, ref_k, ref_v, meta.slot_mapping)
            ops.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
            written = bool(torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v))
            ref = paged_attention_reference(
                query, ref_k, ref_v, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                scale=dim**-0.5, max_query_len=meta.max_query_len,
                max_context_len=meta.max_context_len).float()
            out = ops.attention(query, k_cache, v_cache, meta, dim**-0.5).float()
            err = (out - ref).abs().max().item()
            atol, rtol = (3e-2, 2e-2) if dtype == torch.bfloat16 else (5e-3, 5e-3)
            ok = bool(torch.allclose(out, ref, atol=atol, rtol=rtol)) and written
            results[f"{str(dtype)[6:]} bs{block_size} gqa{gqa}"] = {
                "max_abs_err": err, "write_kv_exact": written, "ok": ok}
    return results


def check_parity(device: str, tiny: bool, errors: dict) -> dict:
    """Plait's forward (through the engine's ops table: Triton on CUDA) against
    transformers' logits. A dtype that fails is recorded in `errors` and the other still
    runs."""
    shape = dict(TINY if tiny else BIG, num_hidden_layers=2 if tiny else 4)
    results = {}
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 0.25)):
        if device == "cpu" and dtype == torch.bfloat16:
            continue
        name = str(dtype)[6:]
        try:
            results[name] = _parity_one(shape, device, dtype, tol)
        except Exception as exc:
            results[name] = errors[f"parity {name}"] = describe(exc)
    return results


def _parity_one(shape: dict, device: str, dtype: torch.dtype, tol: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_model_dir(shape, Path(tmp), device, dtype)
        cfg = ModelConfig.from_dir(Path(tmp))
        bs, nb = 16, 32
        ops = engine_ops(device, dtype, cfg, bs)
        with torch.device(device):
            ours = LlamaForCausalLM(cfg, 2048, ops)
        load_weights(ours, Path(tmp))
        ours = ours.to(dtype).eval()
        if device == "cpu":  # the product rows the runner gives the ops table's linears
            apply_products(ours, ProductSettings(ops.cpu_gemm, ops.native))
    ids = torch.randint(2, shape["vocab_size"], (200,), device=device)
    kv = [(torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype),
           torch.zeros(nb, bs, cfg.num_kv_heads, cfg.head_dim, device=device, dtype=dtype))
          for _ in range(cfg.num_layers)]
    ours.bind(kv)
    table = torch.randperm(nb, device=device)[:13].to(torch.int32)
    positions = torch.arange(200, device=device)
    slots = table.long()[positions // bs] * bs + positions % bs
    meta = AttentionMetadata(slots, torch.tensor([0, 200], device=device, dtype=torch.int32),
                             torch.tensor([200], device=device, dtype=torch.int32),
                             table[None], 200, 200)
    with torch.inference_mode():
        meta = ops.plan(meta, positions)  # once per step, as the runner does
        got = ours.compute_logits(ours(ids, positions, meta))
        ref = hf(ids[None]).logits[0].float()
    err = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"max_abs_err": err, "argmax_agreement": agree, "ok": err < tol,
            "ops": ops.describe()}


def hf_generate_tok_s(hf, prompts: list[list[int]], max_tokens: int, n: int = 1) -> tuple:
    ids = torch.tensor(prompts, device=hf.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=n > 1, num_return_sequences=n,
                          top_k=0, pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - start
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / elapsed, elapsed


def plait_tok_s(llm: LLM, prompts: list[list[int]], max_tokens: int, n: int = 1) -> tuple:
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens,
                            ignore_eos=True, seed=0)
    start = time.perf_counter()
    try:
        out = llm.generate(prompts, params)
    except Exception as exc:  # the engine's own error says more than the request's
        raise RuntimeError(f"{exc} (engine last_error: {llm.engine.last_error})") from exc
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for r in out for o in r.outputs)
    return generated / elapsed, elapsed


def bench(device: str, tiny: bool, model_dir: Path, hf) -> dict:
    shape = TINY if tiny else BIG
    vocab = shape["vocab_size"]
    rng = random.Random(0)
    llm = LLM(str(model_dir), device=device, max_num_seqs=256, max_num_batched_tokens=8192,
              **({"num_kv_blocks": 512} if tiny else {}))
    decode = []
    prompt_len, max_tokens = (16, 8) if tiny else (128, 128)

    def random_prompts(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(batch)]

    for batch in (1, 32, 128):
        # Untimed first: the same shapes (so every Triton variant compiles), other tokens
        # (so nothing of it is in the prefix cache).
        plait_tok_s(llm, random_prompts(batch, prompt_len), max_tokens)
        hf_generate_tok_s(hf, random_prompts(batch, prompt_len), 4)
        prompts = random_prompts(batch, prompt_len)
        p_rate, p_s = plait_tok_s(llm, prompts, max_tokens)
        h_rate, h_s = hf_generate_tok_s(hf, prompts, max_tokens)
        decode.append({"batch": batch, "plait_tok_s": p_rate, "hf_tok_s": h_rate,
                       "plait_s": p_s, "hf_s": h_s, "ratio": p_rate / h_rate})
    shared = []
    plen = 64 if tiny else 512
    for n in (1, 100):
        plait_tok_s(llm, random_prompts(1, plen), 1, n=n)  # untimed, as above
        hf_generate_tok_s(hf, random_prompts(1, plen), 1, n=n)
        ids = random_prompts(1, plen)[0]
        before = llm.stats().prompt_tokens_computed
        _, p_s = plait_tok_s(llm, [ids], 1, n=n)
        computed = llm.stats().prompt_tokens_computed - before
        _, h_s = hf_generate_tok_s(hf, [ids], 1, n=n)
        shared.append({"n": n, "prompt_len": plen, "plait_s": p_s, "hf_s": h_s,
                       "plait_prompt_tokens_computed": computed, "speedup": h_s / p_s})
    return {"decode": decode, "shared_prefill": shared}


def bandwidth(device: str) -> dict:
    if device != "cuda":
        return {"skipped": "needs CUDA"}
    bench_decode = load_script("bench_decode")
    copy = bench_decode.measure_copy_bandwidth(2 << 30)
    rows = []
    for num_seqs, ctx in ((32, 4096), (128, 2048), (8, 32768)):
        r = bench_decode.measure_decode_bandwidth(num_seqs, ctx, 32, 8, 128, 16, torch.bfloat16)
        rows.append({"num_seqs": num_seqs, "context_len": ctx, "gbps": r["gbps"],
                     "fraction_of_copy": r["gbps"] / copy, "time_ms": r["time_ms"]})
    return {"copy_gbps": copy, "decode": rows}


def to_markdown(results: dict) -> str:
    lines = [f"# GPU check ({results['device_name']}, {results['date']})", ""]
    for name in ("kernels", "parity"):
        lines += [f"## {name}", "", "| case | max abs err | ok |", "|---|---|---|"]
        for case, r in results.get(name, {}).items():
            if isinstance(r, dict):
                lines.append(f"| {case} | {r.get('max_abs_err', 0):.3g} | {r.get('ok')} |")
            else:
                lines.append(f"| {case} | {r} | |")
        lines.append("")
    b = results.get("bench", {})
    if "decode" in b:
        lines += ["## decode throughput (generated tokens/s)", "",
                  "| batch | Plait | transformers | ratio |", "|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['plait_tok_s']:.0f} | {r['hf_tok_s']:.0f} | "
                  f"{r['ratio']:.2f}x |" for r in b["decode"]]
        lines += ["", "## shared prefill (max_tokens=1)", "",
                  "| n | prompt | Plait s | Plait prompt tokens computed | transformers s | "
                  "speed-up |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['n']} | {r['prompt_len']} | {r['plait_s']:.3f} | "
                  f"{r['plait_prompt_tokens_computed']} | {r['hf_s']:.3f} | {r['speedup']:.1f}x |"
                  for r in b["shared_prefill"]]
    bw = results.get("bandwidth", {})
    if "decode" in bw:
        lines += ["", f"## decode attention bandwidth (copy: {bw['copy_gbps']:.0f} GB/s)", "",
                  "| seqs | context | GB/s | of copy |", "|---|---|---|---|"]
        lines += [f"| {r['num_seqs']} | {r['context_len']} | {r['gbps']:.0f} | "
                  f"{100 * r['fraction_of_copy']:.0f}% |" for r in bw["decode"]]
    errors = results.get("errors", {})
    if errors:
        lines += ["", "## errors", ""] + [f"- {k}: {v}" for k, v in errors.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    results: dict = {
        "date": time.strftime("%Y-%m-%d"), "device": args.device, "torch": torch.__version__,
        "device_name": (torch.cuda.get_device_name() if args.device == "cuda" else "cpu"),
        "errors": {},
    }
    sections = [("kernels", lambda: check_kernels(args.device)),
                ("parity", lambda: check_parity(args.device, args.tiny, results["errors"])),
                ("bandwidth", lambda: bandwidth(args.device))]
    for name, fn in sections:
        run_section(results, name, fn, out)
    with tempfile.TemporaryDirectory() as tmp:
        def run_bench() -> dict:
            hf = build_model_dir(TINY if args.tiny else BIG, Path(tmp), args.device, dtype)
            return bench(args.device, args.tiny, Path(tmp), hf)

        run_section(results, "bench", run_bench, out)
    print(to_markdown(results))
    return 1 if results["errors"] else 0


def save(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(to_markdown(results))


def describe(exc: Exception) -> str:
    """Print the traceback (to the log) and return the one-line error for the results."""
    traceback.print_exc()
    return f"{type(exc).__name__}: {exc}"


def run_section(results: dict, name: str, fn, out: Path) -> None:
    """Run one section, record its result or its error, and save everything so far."""
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as exc:  # keep going: one broken section must not hide the others
        results["errors"][name] = describe(exc)
    seconds = results.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
    save(results, out)
    print(f"[gpu_check] {name}: {seconds}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
