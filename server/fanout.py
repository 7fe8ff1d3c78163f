"""Fan-out: one HTTP request -> `num_prompts * num_samples` engine sub-requests.

    prompt p, sample j  ->  choice slot p * num_samples + j
                            engine id "<request_id>-<slot>", params.for_choice(j)

`for_choice(j)` gives n=1 and seed+j (when seeded), so prompt p's samples are what the same
prompt alone with the same seed would give. The engine never sees `n`; the sub-requests of
one prompt share its prefill through the engine's prefix cache and prompt sharing.
"""

from __future__ import annotations

import logging

from plait.engine import (
    EngineClient,
    EngineDeadError,
    RequestStream,
    SamplingParams,
)
from plait.server.errors import (
    ENGINE_STOPPED_MESSAGE,
    OVERLOADED_RETRY_AFTER_S,
    APIError,
    bad_request,
    service_unavailable,
)

logger = logging.getLogger("plait.server")


class FanOut:
    """Owns the sub-requests of one HTTP request; `abort()` stops every unfinished one.

    Call on the event loop thread. `start` is all-or-nothing: if the engine refuses one
    sub-request, the ones already added are aborted and an `APIError` is raised.
    """

    def __init__(self, engine: EngineClient, request_id: str, max_queued_requests: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.max_queued_requests = max_queued_requests
        self.streams: dict[int, RequestStream] = {}

    def start(self, prompts: list[list[int]], params: SamplingParams,
              num_samples: int) -> dict[int, RequestStream]:
        """Add every sub-request (each prompt passed `validate_request`); returns the
        streams by choice slot."""
        self._check_load(len(prompts) * num_samples,
                         "best_of" if num_samples > params.n else "n")
        slots = [(p * num_samples + j, token_ids, j) for p, token_ids in enumerate(prompts)
                 for j in range(num_samples)]
        try:  # one command: the engine starts every choice in the same step
            streams = self.engine.add_requests([
                (f"{self.request_id}-{slot}", token_ids, params.for_choice(j))
                for slot, token_ids, j in slots])
            self.streams = {slot: stream for (slot, _, _), stream in zip(slots, streams,
                                                                        strict=True)}
        except EngineDeadError:
            self.abort()
            raise service_unavailable(ENGINE_STOPPED_MESSAGE) from None
        return self.streams

    def abort(self) -> None:
        """Abort every sub-request that has not delivered its final delta (idempotent)."""
        unfinished = [slot for slot, stream in self.streams.items() if not stream.finished]
        for slot in unfinished:
            self.engine.abort(f"{self.request_id}-{slot}")
        if unfinished:
            logger.info("request %s: aborted %d sub-request(s)", self.request_id,
                        len(unfinished))
        self.streams = {}

    def _check_load(self, num_new: int, sample_param: str) -> None:
        """Admission: at most max_num_seqs + max_queued_requests sub-requests in the engine.

            admitted: [ running slots (max_num_seqs) | queue (max_queued_requests) ]
            new request of num_new sub-requests: fits whole -> admitted, else 503 whole

        A request bigger than the whole window could never be admitted: 400, not 503."""
        capacity = check_num_sequences(self.engine, self.max_queued_requests, num_new,
                                       sample_param)
        if self.engine.num_queued + num_new > capacity:
            raise APIError(503, "The server is overloaded with requests; retry shortly.",
                           type="server_error", code="overloaded",
                           headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})


def check_num_sequences(engine: EngineClient, max_queued_requests: int, num_new: int,
                        sample_param: str) -> int:
    """400 `too_many_sequences` for a request of `num_new` sub-requests that could never be
    admitted, even on an idle server (routes call it before tokenizing, so that such a
    request costs nothing). Returns the admission window's size."""
    capacity = engine.config.max_num_seqs + max_queued_requests
    if num_new > capacity:
        raise bad_request(
            f"This request needs {num_new} sequences (prompts x n, or best_of), more than "
            f"this server ever admits at once ({capacity}).", sample_param,
            "too_many_sequences")
    return capacity
