"""llama.cpp's own quality figures for scripts/quality.py: the same GGUF file against the same
weights in F32, scored on the same text by `llama-perplexity --kl-divergence`.

    f32_gguf(tools, model, work_dir)     model.gguf -> <work_dir>/<stem>.f32.gguf, made once
        by `llama-quantize --allow-requantize --pure MODEL OUT F32`: every tensor
        dequantized to F32 (the same weight values, no further rounding)
    kld_base(tools, f32, text, ...)      `llama-perplexity -m F32 --kl-divergence-base FILE`:
        the F32 run's log-probabilities of every scored position, saved once
    kld(tools, model, base, ...)         `llama-perplexity -m MODEL --kl-divergence-base FILE
        --kl-divergence`: the quantized run against them -> LlamaFigures

Files are kept in `work_dir` and reused when present (delete them to redo a step).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from quality_scores import LlamaFigures, parse_llama_kld


@dataclass(frozen=True, slots=True)
class LlamaTools:
    """A llama.cpp build's bin folder (llama-perplexity and llama-quantize in it), and the
    threads its runs use."""

    bin_dir: Path
    threads: int

    def tool(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.is_file():
            raise SystemExit(f"{path} is missing: build it with `cmake --build BUILD "
                             f"--target {name}` in the llama.cpp checkout")
        return str(path)


def _run(argv: list[str], log_path: Path) -> str:
    """Run a llama.cpp tool, its output into `log_path`; SystemExit with the log's tail when
    it fails. Returns the output."""
    print(f"[llama.cpp] {' '.join(argv)}", file=sys.stderr)
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace")
    log_path.write_text(result.stdout)
    if result.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({result.returncode}), log {log_path}:\n"
                         f"{result.stdout[-2000:]}")
    return result.stdout


def f32_gguf(tools: LlamaTools, model: Path, work_dir: Path) -> Path:
    """The model's weights as an F32 GGUF (made once, then reused)."""
    out = work_dir / f"{model.stem}.f32.gguf"
    if not out.exists():
        partial = out.with_suffix(".partial")
        _run([tools.tool("llama-quantize"), "--allow-requantize", "--pure", str(model),
              str(partial), "F32", str(tools.threads)], work_dir / f"{model.stem}.f32.log")
        partial.rename(out)
    return out


def kld_base(tools: LlamaTools, f32: Path, text: Path, n_ctx: int, num_chunks: int,
             work_dir: Path) -> Path:
    """The F32 run's scores of `num_chunks` chunks of `text` (made once, then reused)."""
    out = work_dir / f"{f32.stem}.{text.name}.{num_chunks}x{n_ctx}.kld"
    if not out.exists():
        partial = out.with_suffix(".partial")
        _run([tools.tool("llama-perplexity"), "-m", str(f32), "-f", str(text),
              "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(num_chunks),
              "-t", str(tools.threads), "--kl-divergence-base", str(partial)],
             out.with_suffix(".log"))
        partial.rename(out)
    return out


def kld(tools: LlamaTools, model: Path, base: Path, n_ctx: int, work_dir: Path
        ) -> LlamaFigures:
    """`model` scored against the F32 base on the base's tokens."""
    log = _run([tools.tool("llama-perplexity"), "-m", str(model), "-c", str(n_ctx),
                "-b", str(n_ctx), "-t", str(tools.threads), "--kl-divergence-base",
                str(base), "--kl-divergence"], work_dir / f"{model.stem}.{base.stem}.kld.log")
    return parse_llama_kld(log)
