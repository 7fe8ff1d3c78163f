"""The requests of a `plait bench` run, built before the clock starts.

    random   --num-requests prompts of --input-len tokens, n=--n (default 1) each
    shared   the same with n=--n (default 8): each request's prompt is its own, shared by
             its n choices (what Plait prefills once), so no request hits another's cache
    dataset  a JSONL file, one {"prompt": str} or {"messages": [...]} per line, with an
             optional "max_tokens"; cycled or cut to --num-requests
    edit     W6, a code edit on real text (plait/bench/texts.py): greedy chat, one stream
    quote    W7, a summary quoting a long real text: greedy chat, one stream

Random prompts are common English words drawn with --seed (most are one token with a
leading space in the usual BPE vocabularies). Where the server answers POST /tokenize
(Plait, vLLM) the word count is adjusted until the prompt, as sent (chat template included
on the chat endpoint), has exactly --input-len tokens, or the closest count a word
boundary allows; elsewhere one word is taken as one token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.bench.client import RequestSpec
from plait.bench.texts import TEXT_KINDS, text_prompt

WORKLOAD_KINDS = ("random", "shared", "dataset", *TEXT_KINDS)
DEFAULT_N = {"random": 1, "shared": 8, "dataset": 1, "edit": 1, "quote": 1}
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study "
    "book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city name team minute idea kid body back parent face level "
    "office door health person art war history party result change morning reason research "
    "girl moment air teacher force education")
WORDS = _WORD_TEXT.split()
MAX_FIT_CALLS = 8  # /tokenize calls per prompt before settling for the closest length

CountTokens = Callable[[str], Awaitable[int | None]]


class DatasetError(ValueError):
    """A dataset file that cannot be read, or a line that is no valid request."""


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send. `n` None takes the kind's default (DEFAULT_N); `num_requests` None on
    a dataset sends each line once."""

    kind: str
    num_requests: int | None
    input_len: int
    output_len: int | None
    n: int | None = None
    dataset: Path | None = None
    seed: int = 0


def random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def fit_prompt(rng: random.Random, target: int,
                     count: CountTokens | None) -> tuple[str, int | None]:
    """A random-word prompt of `target` tokens and its measured count (None: unmeasured,
    one word per token assumed). With `count`, the word count moves by the miss until the
    count is exact; otherwise the closest count at or under the target wins."""
    pool = [rng.choice(WORDS) for _ in range(2 * target + 16)]
    num_words = target
    measured = await count(" ".join(pool[:num_words])) if count is not None else None
    if count is None or measured is None:
        return " ".join(pool[:num_words]), None
    seen = {num_words: measured}
    for _ in range(MAX_FIT_CALLS - 1):
        if measured == target:
            break
        num_words = min(max(1, num_words + target - measured), len(pool))
        if num_words in seen:
            break
        measured = await count(" ".join(pool[:num_words]))
        if measured is None:
            break
        seen[num_words] = measured
    best = min(seen, key=lambda k: (abs(seen[k] - target), seen[k] > target))
    return " ".join(pool[:best]), seen[best]


def load_dataset(path: Path) -> list[RequestSpec]:
    """Every non-blank line of a JSONL file as a RequestSpec. Raises DatasetError naming
    the file and line of the first bad one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc}") from None
    specs = [_parse_line(line, f"{path}:{number}")
             for number, line in enumerate(lines, 1) if line.strip()]
    if not specs:
        raise DatasetError(f"dataset {path} holds no request")
    return specs


def _parse_line(line: str, where: str) -> RequestSpec:
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f'{where}: expected an object with "prompt" or "messages"')
    prompt, messages, max_tokens = row.get("prompt"), row.get("messages"), row.get("max_tokens")
    if (prompt is None) == (messages is None):
        raise DatasetError(f'{where}: give exactly one of "prompt" and "messages"')
    if prompt is not None and not isinstance(prompt, str):
        raise DatasetError(f'{where}: "prompt" must be a string')
    if messages is not None and not (
            isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise DatasetError(f'{where}: "messages" must be a non-empty list of objects with a '
                           '"role"')
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise DatasetError(f'{where}: "max_tokens" must be an integer >= 1')
    return RequestSpec(prompt=prompt, messages=messages, max_tokens=max_tokens)


async def build_requests(workload: Workload, count: CountTokens | None,
                         dataset: list[RequestSpec] | None = None
                         ) -> tuple[list[RequestSpec], list[int | None]]:
    """The run's requests and each one's measured prompt tokens (None where unmeasured;
    always None for a dataset and the text kinds). `dataset` is load_dataset's result for
    the dataset kind. A text kind sends its one prompt --num-requests times (its own
    max_tokens unless --output-len is given)."""
    n = workload.n or DEFAULT_N[workload.kind]
    if workload.kind in TEXT_KINDS:
        prompt = text_prompt(workload.kind)
        total = workload.num_requests or 1
        return ([RequestSpec(messages=prompt.messages,
                             max_tokens=workload.output_len or prompt.max_tokens, n=n)
                 for _ in range(total)], [None] * total)
    if workload.kind == "dataset":
        if dataset is None:
            raise ValueError("the dataset kind needs load_dataset's requests")
        total = workload.num_requests or len(dataset)
        specs = [RequestSpec(row.prompt, row.messages, row.max_tokens or workload.output_len, n)
                 for row in (dataset[i % len(dataset)] for i in range(total))]
        return specs, [None] * total
    rng = random.Random(workload.seed)
    specs, counts = [], []
    for _ in range(workload.num_requests or 0):
        text, measured = await fit_prompt(rng, workload.input_len, count)
        specs.append(RequestSpec(prompt=text, max_tokens=workload.output_len, n=n))
        counts.append(measured)
    return specs, counts
