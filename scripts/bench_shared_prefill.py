#!/usr/bin/env python3
"""Shared-prefill benchmark: Plait vs transformers `generate` on the same weights, one run.

Table 1: a 512-token prompt, max_tokens=1, n in {1, 8, 32, 100}: wall time and prompt
tokens computed. Plait fans n out into n sub-requests that share one prefill; transformers
`generate(num_return_sequences=n, do_sample=True)` expands the prompt n times.
Table 2: decode throughput at n=16, max_tokens=128 (generated tokens per second).

Each n uses a fresh random prompt, so no run is served by an earlier run's cache.

    python scripts/bench_shared_prefill.py [--model PATH] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from plait import LLM, SamplingParams
from plait.engine.model_loader import resolve_model

PROMPT_LEN = 512


def random_prompt(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]


def plait_run(llm: LLM, ids: list[int], n: int, max_tokens: int) -> tuple[float, int, int]:
    """Returns (seconds, prompt tokens computed, tokens generated)."""
    before = llm.stats()
    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([ids], params)
    elapsed = time.perf_counter() - start
    computed = llm.stats().prompt_tokens_computed - before.prompt_tokens_computed
    generated = sum(len(o.token_ids) for o in out[0].outputs)
    return elapsed, computed, generated


def hf_run(model, ids: list[int], n: int, max_tokens: int) -> tuple[float, int, int]:
    input_ids = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             num_return_sequences=n, do_sample=True, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, top_k=0, pad_token_id=0)
    elapsed = time.perf_counter() - start
    generated = (out.shape[1] - len(ids)) * out.shape[0]
    return elapsed, len(ids) * n, generated  # generate prefills the expanded batch: n x prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2)")
    parser.add_argument("--ns", default="1,8,32,100")
    parser.add_argument("--decode-n", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    resolved = resolve_model(args.model)
    llm = LLM(args.model)
    hf = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    vocab = resolved.config.vocab_size
    print(f"model {resolved.name}, device {llm.engine.info.device}, "
          f"torch threads {torch.get_num_threads()}")
    plait_run(llm, random_prompt(999, vocab), 2, 2)  # warm-up, both sides
    hf_run(hf, random_prompt(998, vocab)[:64], 2, 2)

    results: dict[str, list] = {"prefill": [], "decode": []}
    print(f"\nTable 1: prompt {PROMPT_LEN} tokens, max_tokens=1")
    print("| n | Plait s | Plait prompt tokens computed | transformers s | transformers prompt "
          "tokens | speed-up |")
    print("|---|---|---|---|---|---|")
    for n in (int(x) for x in args.ns.split(",")):
        ids = random_prompt(n, vocab)
        p_s, p_comp, _ = plait_run(llm, ids, n, 1)
        h_s, h_comp, _ = hf_run(hf, ids, n, 1)
        results["prefill"].append(dict(n=n, plait_s=p_s, plait_prompt_tokens_computed=p_comp,
                                       hf_s=h_s, hf_prompt_tokens=h_comp))
        print(f"| {n} | {p_s:.3f} | {p_comp} | {h_s:.3f} | {h_comp} | {h_s / p_s:.1f}x |")
    by_n = {r["n"]: r for r in results["prefill"]}
    if 1 in by_n and 100 in by_n:
        ratio = by_n[100]["plait_s"] / by_n[1]["plait_s"]
        print(f"\nPlait t(n=100) / t(n=1) = {ratio:.2f}")

    n, tokens = args.decode_n, args.decode_tokens
    ids = random_prompt(7777, vocab)[:64]
    p_s, _, p_gen = plait_run(llm, ids, n, tokens)
    h_s, _, h_gen = hf_run(hf, ids, n, tokens)
    results["decode"].append(dict(n=n, max_tokens=tokens, plait_tok_s=p_gen / p_s,
                                  hf_tok_s=h_gen / h_s))
    print(f"\nTable 2: decode, n={n}, max_tokens={tokens}, 64-token prompt")
    print("| engine | generated tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    print(f"| Plait | {p_gen} | {p_s:.2f} | {p_gen / p_s:.1f} |")
    print(f"| transformers generate | {h_gen} | {h_s:.2f} | {h_gen / h_s:.1f} |")
    print(f"\nPlait / transformers decode throughput = {(p_gen / p_s) / (h_gen / h_s):.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
