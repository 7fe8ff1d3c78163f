"""Where a decode step's time goes: torch.profiler over `LLM.generate` of n choices x T
tokens from a 512-token prompt (seeded, temperature 0.8, EOS ignored), ops by self CPU time
per step. The prompt's blocks are cached by a warm-up run first, so the figures are decode.
`--unique`: instead n different ~512-token prompts of one choice each, submitted at once,
prefills included (W4 of bench_peers.py in-process); op times are then totals in seconds.
The native CPU kernels (ctypes calls the profiler cannot see) are wrapped in
`record_function` ranges named `plait::native_<kernel>`: the attributes of
`plait.kernels.cpu.native` are replaced before the engine starts (the ops table, the linear
layers and the sampler call them through the module, so they reach the wrappers).

    python scripts/profile_step.py [--n 16] [--tokens 32] [--unique] [--model FILE.gguf]
        [--weights auto|float32] [--numerics auto|int8|bf16|exact]
        [--kv-cache-dtype auto|bfloat16] [--kv-cache-prefault]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from plait import LLM, SamplingParams
from plait.bench.workloads import random_words
from plait.kernels.cpu import native, repack


def _label_native_kernels() -> None:
    """Make the native kernels' calls visible to torch.profiler (the whole-stack call lives
    in `plait.kernels.cpu.stack`; older checkouts had it in `native`: either is wrapped)."""
    modules = [native, repack]
    try:
        from plait.kernels.cpu import stack
        modules.append(stack)
    except ImportError:
        pass
    for name in ("gemm", "qgemm", "product", "dequantize", "decode_attention", "rope_write_kv",
                 "sample_inverse_cdf", "add_rms_norm", "silu_mul", "decoder_stack"):
        for module in modules:
            kernel = getattr(module, name, None)
            if kernel is None:
                continue

            def labelled(*args, _kernel=kernel, _label=f"plait::native_{name}", **kwargs):
                with torch.profiler.record_function(_label):
                    return _kernel(*args, **kwargs)

            setattr(module, name, labelled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--unique", action="store_true")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--weights", default="auto", help="auto (the file's format) or float32")
    parser.add_argument("--numerics", default="auto", help="auto, int8, bf16 or exact")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (as --numerics says) or bfloat16")
    parser.add_argument("--kv-cache-prefault", action="store_true",
                        help="make the whole KV pool resident at start")
    args = parser.parse_args()
    _label_native_kernels()
    llm = LLM(args.model, weights=args.weights, numerics=args.numerics,
              kv_cache_dtype=args.kv_cache_dtype, kv_cache_prefault=args.kv_cache_prefault)
    if args.unique:
        _profile_unique(llm, args)
        return
    ids = llm.tokenizer.encode("The history of the river " * 120)[:512]
    llm.generate([ids], SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    params = SamplingParams(n=args.n, temperature=0.8, seed=1, max_tokens=args.tokens,
                            ignore_eos=True)
    steps = args.tokens
    start = time.perf_counter()
    llm.generate([[*ids[:-2], 6, 9]], params)
    wall = time.perf_counter() - start
    print(f"unprofiled: {args.n * steps / wall:.1f} tok/s, {wall / steps * 1e3:.1f} ms/step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([[*ids[:-2], 6, 7]], params)
        wall = time.perf_counter() - start
    print(f"profiled: {wall / steps * 1e3:.1f} ms/step")
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
    for event in events:
        print(f"{event.key[:60]:60s} calls/step {event.count / steps:7.1f}  "
              f"self ms/step {event.self_cpu_time_total / steps / 1e3:7.2f}")


def _profile_unique(llm: LLM, args: argparse.Namespace) -> None:
    """n unique prompts x T tokens at once (the W4 shape), unprofiled then profiled."""
    rng = random.Random(0)

    def prompts(tag: str) -> list[list[int]]:
        return [llm.tokenizer.encode(f"{tag}{i} " + random_words(rng, 600))[:512]
                for i in range(args.n)]

    llm.generate(prompts("warm")[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True)
    batch = prompts("a")
    start = time.perf_counter()
    llm.generate(batch, params)
    wall = time.perf_counter() - start
    print(f"unprofiled: {args.n * args.tokens / wall:.1f} tok/s, {wall:.2f} s")
    batch = prompts("b")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(batch, params)
        wall = time.perf_counter() - start
    print(f"profiled: {wall:.2f} s")
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]:
        print(f"{event.key[:60]:60s} calls {event.count:7d}  "
              f"self s {event.self_cpu_time_total / 1e6:7.3f}")


if __name__ == "__main__":
    main()
