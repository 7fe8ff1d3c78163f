"""The in-memory store of responses: what `previous_response_id`, `GET /v1/responses/{id}`,
`/input_items` and `DELETE` read. Bounded in entries and in time:

    put(r5) with max_entries=4:   [r1 r2 r3 r4] -> drop expired from the front, then the
                                  oldest while full -> [r2 r3 r4 r5]
    get(id) after its TTL:        dropped, None (an expired response is a 404, as unknown)

Every entry lives `ttl` seconds from its creation, so the insertion order is also the
expiry order and both bounds evict from the front of one ordered dict (O(1) per eviction).
The store is per process: replicas behind a load balancer each have their own.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Item = dict[str, Any]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A finished response as kept. `input_items`: its request's input (with ids);
    `context`: the conversation a continuation replays, i.e. the earlier turns, then this
    input, then this output (the first choice's for n > 1). Items are shared, not copied,
    between the entries of one conversation."""

    response: dict[str, Any]
    input_items: list[Item]
    context: list[Item]
    expires_at: float


class ResponseStore:
    """At most `max_entries` responses (0: keep nothing), each for `ttl` seconds.
    `clock` is injectable for tests (monotonic seconds)."""

    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or ttl <= 0:
            raise ValueError("max_entries must be >= 0 and ttl > 0")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict[str, Any], input_items: list[Item],
            context: list[Item]) -> None:
        """Keep `response` (by its id), evicting expired entries, then the oldest."""
        if self.max_entries == 0:
            return
        self._expire()
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)
        self._entries[response["id"]] = StoredResponse(response, input_items, context,
                                                       self._clock() + self.ttl)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown, deleted or expired."""
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget the entry; False when there was none (or it had expired)."""
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                return
            self._entries.popitem(last=False)
