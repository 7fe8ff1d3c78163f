"""PNG plots of a run (matplotlib, the `plot` extra: `pip install 'plait[plot]'`).

    latency_cdf.png  CDFs of TTFT, inter-token latency and end-to-end latency, with the
                     p50 / p90 / p99 marked (in ms, or in s where a sample reaches 10 s)
    throughput.png   output tokens/s over time (each content chunk weighted so a request's
                     chunks add up to its usage token count), and the mean number of
                     requests in flight, in the same time bins
"""

from __future__ import annotations

from pathlib import Path

from plait.bench.metrics import PERCENTILES, latency_samples, percentile
from plait.bench.runner import RequestRecord, RunResult

NUM_BINS = 40
MISSING = ("--plot needs matplotlib, which is not installed; install the plot extra: "
           "pip install 'plait[plot]' (or pip install matplotlib)")


class PlotError(RuntimeError):
    """The plots cannot be drawn (matplotlib missing)."""


def require_matplotlib() -> None:
    """Raise PlotError unless matplotlib imports (checked before a run, not after it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(MISSING) from None


def _cdf_figure(records: list[RequestRecord], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    samples = latency_samples(records)
    series = {"time to first token": samples.ttft, "inter-token latency": samples.itl,
              "end-to-end latency": samples.e2e}
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        unit, scale = ("s", 1) if values and max(values) >= 10 else ("ms", 1000)
        ordered = sorted(v * scale for v in values)
        if ordered:
            fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, fractions, where="post")
            for p in PERCENTILES:
                value = percentile(ordered, p / 100)
                if value is None:  # (not reached: `ordered` is not empty)
                    continue
                ax.axvline(value, linestyle=":", color="grey")
                label = f"{value:.0f}" if value >= 100 else f"{value:.3g}"
                ax.annotate(f"p{p} {label}", (value, p / 100), fontsize=8,
                            xytext=(3, -10), textcoords="offset points")
        ax.set(title=f"{name} ({len(ordered)} samples)", xlabel=unit, ylabel="fraction",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _throughput_figure(run: RunResult, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    records = [r for r in run.records if r.result.error is None]
    width = max(run.duration_s / NUM_BINS, 0.01)
    tokens = [0.0] * NUM_BINS

    def bin_of(t: float) -> int:
        return min(int(t / width), NUM_BINS - 1)

    for record in records:
        result = record.result
        weight = result.output_tokens / result.num_chunks if result.num_chunks else 0.0
        for times in result.token_times.values():
            for t in times:
                tokens[bin_of(record.start_s + t)] += weight
    edges = [i * width for i in range(NUM_BINS)]
    busy = [0.0] * NUM_BINS  # request-seconds in flight within each bin
    for record in run.records:
        begin, end = record.start_s, record.start_s + (record.result.e2e_s or 0.0)
        for i in range(bin_of(begin), bin_of(end) + 1):
            busy[i] += max(0.0, min(end, edges[i] + width) - max(begin, edges[i]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.bar(edges, [t / width for t in tokens], width=width, align="edge")
    top.set(ylabel="output tokens / s", title=title)
    bottom.bar(edges, [b / width for b in busy], width=width, align="edge", color="tab:orange")
    bottom.set(xlabel="seconds since the first request", ylabel="requests in flight (mean)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_xlim(0, NUM_BINS * width)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_plots(run: RunResult, folder: Path, title: str) -> list[Path]:
    """Write latency_cdf.png and throughput.png into `folder` (created); their paths."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "latency_cdf.png", folder / "throughput.png"]
    _cdf_figure(run.records, title, paths[0])
    _throughput_figure(run, title, paths[1])
    return paths
