"""Speculative decoding's counters from a server's Prometheus /metrics, under vLLM's names
(which Plait exports too; llama-server started with `--metrics` has the same ones under
`llamacpp:`), and what a run's difference of two scrapes says:

    acceptance rate           accepted draft tokens / draft tokens
    mean acceptance length    1 + accepted draft tokens / drafts   (tokens per verify step)

A server without these counters scrapes as None, and the figures are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

DRAFTS = "spec_decode_num_drafts"
DRAFT_TOKENS = "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PREFIXES = ("vllm:", "llamacpp:")


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """The three counters' values, summed over their label sets."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float

    def minus(self, before: SpecCounters) -> SpecCounters:
        return SpecCounters(self.drafts - before.drafts,
                            self.draft_tokens - before.draft_tokens,
                            self.accepted_tokens - before.accepted_tokens)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def describe(self) -> str:
        """One line for a report, e.g. "12 drafts, 48 draft tokens, 30 accepted (62.5%),
        mean acceptance length 3.50"."""
        rate, length = self.acceptance_rate, self.mean_acceptance_length
        return (f"{self.drafts:.0f} drafts, {self.draft_tokens:.0f} draft tokens, "
                f"{self.accepted_tokens:.0f} accepted"
                + ("" if rate is None else f" ({100 * rate:.1f}%)")
                + ("" if length is None else f", mean acceptance length {length:.2f}"))


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The counters in a Prometheus text exposition, or None when the drafts counter is
    absent. A counter may be exposed with either prefix (PREFIXES), with or without the
    `_total` suffix, with labels."""
    sums = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        prefix, _, name = name_part.split("{", 1)[0].removesuffix("_total").partition(":")
        if f"{prefix}:" in PREFIXES and name in sums:
            try:
                sums[name] += float(value)
            except ValueError:
                continue
            seen = seen or name == DRAFTS
    if not seen:
        return None
    return SpecCounters(sums[DRAFTS], sums[DRAFT_TOKENS], sums[ACCEPTED])


async def fetch_metrics(client: httpx.AsyncClient) -> str | None:
    """The text of GET /metrics; None when the server has none (or did not answer)."""
    import httpx

    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None


async def scrape_spec(client: httpx.AsyncClient) -> SpecCounters | None:
    """GET /metrics and parse it; None when the server has no /metrics or no counters."""
    text = await fetch_metrics(client)
    return None if text is None else parse_spec_counters(text)


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    """What a run added, None unless both scrapes found the counters."""
    return None if before is None or after is None else after.minus(before)
