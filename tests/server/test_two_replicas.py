"""Two real `plait serve` replicas on one machine, routed by their KV-cache events.

A subscriber follows both replicas' events (plain pyzmq SUB + msgpack, test_kv_events.py's
`Subscriber` and `Index`); a small client sends each turn of two multi-turn conversations
either to the replica whose events show the longest cached prefix of the prompt's token ids
(prefix-aware) or round-robin. The servers' own `cached_tokens` and
`plait_prompt_tokens_computed_total` show that prefix-aware routing computes each turn's new
tokens only (and the unfinished last block of the turn before), where round-robin recomputes
the conversation. This tests Plait's side of the
protocol; it is not a router to ship.
"""

from __future__ import annotations

import random

import httpx
import pytest
from helpers.kv_events import Index, Subscriber
from helpers.server import RemoteServer, start_server

BLOCK = 16
TURNS = 4


class Replica:
    def __init__(self, tiny_path) -> None:
        self.sub = Subscriber()
        self.index = Index()
        # The engine (a child process: --engine-process is the default) connects its PUB
        # socket to the subscriber's bound SUB socket, vLLM's "connect" form of the endpoint.
        self.server: RemoteServer = start_server(
            [str(tiny_path), "--block-size", str(BLOCK), "--num-kv-blocks", "512",
             "--served-model-name", "tiny", "--kv-events-endpoint", self.sub.endpoint])
        self.prefixes: set[tuple[int, ...]] = set()
        # The last sequence this replica served, but its last token (whose K/V is never
        # computed): its events store every full block of it.
        self.served: list[int] = []
        self.applied = 0  # batches of sub.live applied to the index

    def wait(self) -> None:
        self.server.wait_healthy()
        self.sub.settle()

    def follow(self) -> None:
        """Apply the events that arrived, waiting for those that cache what this replica
        served last; refresh the cached token prefixes."""
        def caught_up() -> bool:
            for _, batch in self.sub.live[self.applied:]:
                self.index.apply(batch)
            self.applied = len(self.sub.live)
            self.prefixes = self.index.prefixes()
            return self.cached_prefix(self.served) == len(self.served) // BLOCK * BLOCK

        self.sub.receive(caught_up)

    def cached_prefix(self, ids: list[int]) -> int:
        """Tokens of `ids` this replica's events say are cached (whole blocks)."""
        n = 0
        while n + BLOCK <= len(ids) and tuple(ids[:n + BLOCK]) in self.prefixes:
            n += BLOCK
        return n

    def computed(self) -> float:
        return self.server.metrics()["plait_prompt_tokens_computed_total"]

    def complete(self, ids: list[int]) -> tuple[list[int], int]:
        """One completion of a token-id prompt: (its generated ids, its cached_tokens)."""
        body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{self.server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        data = r.json()
        out_ids = data["choices"][0]["token_ids"]
        self.served = ids + out_ids[:-1]
        return out_ids, data["usage"]["prompt_tokens_details"]["cached_tokens"]

    def stop(self) -> None:
        self.server.stop()
        self.sub.close()


@pytest.fixture(scope="module")
def replicas(tiny_path):
    pair = [Replica(tiny_path), Replica(tiny_path)]
    try:
        for replica in pair:
            replica.wait()
        yield pair
    finally:
        for replica in pair:
            replica.stop()


def conversation(seed: int) -> list[list[int]]:
    """Each turn's new user tokens (random ids: the tiny model's vocabulary is the real
    tokenizer's, and a token-id prompt is taken as is)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 40))]
            for _ in range(TURNS)]


def run(replicas: list[Replica], seeds: tuple[int, int], prefix_aware: bool):
    """One conversation after the other. Per turn: (replica, prompt length, new tokens
    since the last turn's prompt, cached_tokens), and the computed-token counters' growth."""
    before = [r.computed() for r in replicas]
    histories: list[list[int]] = [[], []]
    log = []
    turn_no = 0
    for c, seed in enumerate(seeds):
        for turn in range(TURNS):
            prompt_ids = histories[c] + conversation(seed)[turn]
            if prefix_aware:
                for r in replicas:
                    r.follow()
                # the longest cached prefix; on a tie (a new conversation) the replica
                # caching fewer blocks
                pick = max(range(len(replicas)), key=lambda i: (
                    replicas[i].cached_prefix(prompt_ids), -len(replicas[i].index.blocks)))
            else:
                pick = turn_no % len(replicas)
            turn_no += 1
            out_ids, cached = replicas[pick].complete(prompt_ids)
            new = len(prompt_ids) - len(histories[c])
            log.append((c, pick, len(prompt_ids), new, cached))
            histories[c] = prompt_ids + out_ids
    for r in replicas:
        r.follow()
    grown = [r.computed() - b for r, b in zip(replicas, before, strict=True)]
    return log, grown


def test_prefix_aware_routing_computes_only_new_tokens(replicas) -> None:
    aware, aware_computed = run(replicas, (1, 2), prefix_aware=True)
    robin, robin_computed = run(replicas, (3, 4), prefix_aware=False)

    # prefix-aware: each conversation stays on one replica, the two on different ones
    picks = {c: {pick for cc, pick, *_ in aware if cc == c} for c in (0, 1)}
    assert all(len(p) == 1 for p in picks.values()) and picks[0] != picks[1], aware
    for *_, length, new, cached in aware:
        if length == new:
            assert cached == 0  # a first turn: nothing to reuse
            continue
        # a later turn: all of the conversation so far (length - new tokens) but its
        # unfinished last block (the last generated token's K/V is never computed) is cached
        assert cached == (length - new - 1) // BLOCK * BLOCK, aware
        assert length - cached <= new + BLOCK
    # the replicas' counters: the prompts' tokens minus what was cached, nothing more
    assert sum(aware_computed) == sum(length - cached for *_, length, _, cached in aware)

    # round-robin: each turn lands on the other replica than the conversation's last turn,
    # which holds the conversation as it was two turns ago (or nothing)
    assert sum(cached for *_, cached in robin) < sum(cached for *_, cached in aware)
    assert sum(robin_computed) > sum(aware_computed)
    robin_new = sum(new for *_, new, _ in robin)
    aware_new = sum(new for *_, new, _ in aware)
    print(f"\nprefix-aware: {sum(aware_computed):.0f} prompt tokens computed for {aware_new} "
          f"new; round-robin: {sum(robin_computed):.0f} for {robin_new} new")
    # the events of both replicas arrived without a gap
    for r in replicas:
        seqs = [seq for seq, _ in r.sub.live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] == 0
