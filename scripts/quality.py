#!/usr/bin/env python3
"""How faithful each numerics mode of `plait serve` is, measured as llama.cpp measures it.

    python scripts/quality.py --model FILE.gguf [--chunks 14] [--ctx 512]
        [--text /usr/share/common-licenses/GPL-3] [--mode NAME=FLAGS ...] [--reference exact]
        [--llama-bin LLAMA_CPP/build/bin [--llama-tokens]] [--json out.json]

For each mode the script starts its own `plait serve MODEL FLAGS`, tokenizes the text with
the server (`POST /tokenize`), and sends each chunk of `--ctx` tokens as a token-id prompt
to `/v1/completions` with `prompt_logprobs: 1` (vLLM's extra: per prompt token its logprob
and the top-1 alternative). Chunks and scored positions are llama-perplexity's (the second
half of each chunk, BOS first where the model adds one: scripts/quality_scores.py). Per
mode it reports the perplexity, its ratio to the reference mode's, and the fraction of
scored positions whose top-1 token equals the reference's.

With `--llama-bin`, llama.cpp's own figures go beside them: the GGUF's weights dequantized
to an F32 GGUF by `llama-quantize`, `llama-perplexity --kl-divergence-base` on that, then
`--kl-divergence` on the file itself: "Mean PPL(Q)/PPL(base)" and "Same top p" (files in
`--work-dir`, reused when present: scripts/quality_llama.py). llama.cpp tokenizes the
text itself; `--llama-tokens` makes every Plait mode score those very tokens (the two
tokenizers can split whitespace differently), so Plait's exact perplexity and llama.cpp's
F32 one are taken on the same input.

The default modes are the three `--numerics` modes: exact (float32 arithmetic, the
reference), bf16 and int8; `--mode NAME=FLAGS` (repeatable) replaces them, e.g.
`--mode exact=--exact` `--mode int8=--numerics int8`. The server's environment is this
one without PLAIT_* settings; KEY=VALUE words at the start of a mode's FLAGS set variables
for that mode's server, e.g. `--mode int8-vnni=PLAIT_REPACK_AMX=0`. Nothing is asserted;
the figures are printed (BENCHMARKS.md records them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from quality_llama import LlamaTools, f32_gguf, kld, kld_base
from quality_scores import (
    ChunkScores,
    LlamaFigures,
    chunk_tokens,
    compare,
    perplexity,
    read_kld_base_tokens,
    scores_of,
)

from plait.bench.launch import launch_plait

DEFAULT_MODES = {
    "exact": "--numerics exact",
    "bf16": "--numerics bf16",
    "int8": "--numerics int8",
}
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def _server_env() -> dict[str, str]:
    """This environment without PLAIT_* settings (the mode's flags alone choose), except
    the kernel cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLAIT_")}
    if "PLAIT_CACHE" in os.environ:
        env["PLAIT_CACHE"] = os.environ["PLAIT_CACHE"]
    return env


def server_tokens(client: httpx.Client, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as the server makes them for a completions prompt, and the BOS id
    the model puts in front (None when it adds none): the difference between tokenizing
    with and without special tokens."""
    def tokenize(special: bool) -> list[int]:
        reply = client.post("/tokenize", json={"prompt": text, "add_special_tokens": special})
        reply.raise_for_status()
        return list(reply.json()["tokens"])

    with_special, plain = tokenize(True), tokenize(False)
    if with_special == plain:
        return with_special, None
    if with_special[1:] != plain:
        raise SystemExit("the tokenizer adds more than a BOS token; llama-perplexity's "
                         "chunking does not apply")
    return with_special, with_special[0]


def score_chunks(client: httpx.Client, model: str, chunks: list[list[int]]
                 ) -> list[ChunkScores]:
    """Each chunk alone, in order, through /v1/completions with prompt_logprobs=1."""
    scores = []
    for i, chunk in enumerate(chunks):
        began = time.monotonic()
        reply = client.post("/v1/completions", json={
            "model": model, "prompt": chunk, "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 1})
        if reply.status_code != 200:
            raise SystemExit(f"chunk {i}: HTTP {reply.status_code}: {reply.text[:500]}")
        scores.append(scores_of(chunk, reply.json()["choices"][0]["prompt_logprobs"]))
        print(f"  chunk {i + 1}/{len(chunks)}: {time.monotonic() - began:.1f} s, running "
              f"perplexity {perplexity(scores):.4f}", file=sys.stderr)
    return scores


def run_mode(name: str, flags: str, args: argparse.Namespace, given: list[int] | None
             ) -> tuple[list[int], list[ChunkScores]]:
    """Start `plait serve MODEL FLAGS`, score the text's chunks, stop it. Returns the
    text's tokens as this server made them and the chunks' scores; the chunks are cut
    from `given` instead when it is set (llama.cpp's tokens of the text)."""
    words, env = shlex.split(flags), _server_env()
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # KEY=VALUE first: env
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    argv = [str(args.model), *words, *shlex.split(args.server_args), "--log-level", "warning"]
    print(f"[{name}] plait serve {' '.join(argv)}", file=sys.stderr)
    server = launch_plait(argv, env=env, log_prefix=f"quality-{name}-")
    try:
        server.wait_healthy(args.startup_timeout)
        with httpx.Client(base_url=server.url, timeout=args.request_timeout,
                          trust_env=False) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            tokens, bos_id = server_tokens(client, Path(args.text).read_text())
            chunks = chunk_tokens(given or tokens, args.ctx, args.chunks, bos_id)
            return tokens, score_chunks(client, model, chunks)
    finally:
        server.stop()


def run_llama(args: argparse.Namespace) -> tuple[LlamaFigures, list[int]]:
    """llama.cpp's figures for the file against its F32 weights, and the tokens it scored."""
    tools = LlamaTools(Path(args.llama_bin), args.threads)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    f32 = f32_gguf(tools, Path(args.model), work_dir)
    base = kld_base(tools, f32, Path(args.text), args.ctx, args.chunks, work_dir)
    with base.open("rb") as stream:
        _, tokens = read_kld_base_tokens(stream)
    return kld(tools, Path(args.model), base, args.ctx, work_dir), tokens


def report(args: argparse.Namespace, scores: dict[str, list[ChunkScores]],
           llama: LlamaFigures | None, tokens_agree: str) -> dict[str, Any]:
    """Print the table; return the same figures for --json."""
    reference = scores[args.reference]
    rows = {name: compare(run, reference) for name, run in scores.items()}
    count = next(iter(rows.values())).num_scored
    print(f"model {args.model}\ntext {args.text}: {args.chunks} chunks of {args.ctx} tokens, "
          f"{count} scored tokens; reference mode: {args.reference}")
    print("\n| run | perplexity | ratio to reference | same top-1 token |")
    print("| --- | --- | --- | --- |")
    for name, row in rows.items():
        print(f"| plait {name} | {row.perplexity:.4f} | {row.ratio:.4f} | "
              f"{100 * row.same_top1:.1f} % |")
    if llama is not None:
        print(f"| llama.cpp, the file against its F32 weights | {llama.perplexity:.4f} "
              f"(F32 {llama.base_perplexity:.4f}) | {llama.ratio:.4f} | "
              f"{100 * llama.same_top1:.1f} % |")
        print(f"\nllama.cpp mean KL divergence {llama.mean_kld:.6f}; {tokens_agree}")
    return {"model": str(args.model), "text": args.text, "chunks": args.chunks,
            "ctx": args.ctx, "reference": args.reference, "scored_tokens": count,
            "modes": {name: {"flags": args.modes[name], **asdict(row)}
                      for name, row in rows.items()},
            "llama_cpp": asdict(llama) if llama is not None else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a .gguf file")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the text scored")
    parser.add_argument("--chunks", type=int, default=14, help="chunks scored")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--mode", action="append", default=[], metavar="NAME=FLAGS",
                        help="a mode and its `plait serve` flags (repeatable; default: "
                        + ", ".join(f"{k}={v!r}" for k, v in DEFAULT_MODES.items()) + ")")
    parser.add_argument("--reference", default="exact", help="the mode compared against")
    parser.add_argument("--server-args", default="", help="flags added to every mode")
    parser.add_argument("--llama-bin", default=None,
                        help="llama.cpp's bin folder (llama-perplexity, llama-quantize); "
                        "without it llama.cpp is not run")
    parser.add_argument("--llama-tokens", action="store_true",
                        help="score llama.cpp's tokens of the text in every mode too (its "
                        "tokenizer can split a text otherwise), so both score the same tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp threads")
    parser.add_argument("--work-dir", default="/tmp/plait-quality",
                        help="llama.cpp's F32 GGUF, base scores and logs")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    modes = dict(DEFAULT_MODES)
    if args.mode:
        modes = {}
        for spec in args.mode:
            name, sep, flags = spec.partition("=")
            if not sep or not name:
                parser.error(f"--mode {spec!r}: expected NAME=FLAGS")
            modes[name] = flags
    if args.llama_tokens and args.llama_bin is None:
        parser.error("--llama-tokens needs --llama-bin")
    if args.reference not in modes:
        parser.error(f"--reference {args.reference!r} is not one of the modes {list(modes)}")
    args.modes = modes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llama, llama_tokens = run_llama(args) if args.llama_bin is not None else (None, [])
    scores: dict[str, list[ChunkScores]] = {}
    tokens: list[int] = []
    for name, flags in args.modes.items():
        tokens, scores[name] = run_mode(name, flags, args,
                                        llama_tokens if args.llama_tokens else None)
    tokens_agree = ""
    if llama is not None:
        parted = next((i for i, (a, b) in enumerate(zip(tokens, llama_tokens, strict=False))
                       if a != b), None)
        tokens_agree = (f"llama.cpp's {len(llama_tokens)} tokens equal Plait's"
                        if parted is None else
                        f"llama.cpp's tokens part from Plait's at position {parted}")
        tokens_agree += (" (Plait scored llama.cpp's tokens)" if args.llama_tokens
                         else " (Plait scored its own tokens)")
    figures = report(args, scores, llama, tokens_agree)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
