"""`plait bench`: a streaming load generator for any OpenAI-compatible server.

    client.py     one streamed request (SSE) timed token by token; /v1/models, /tokenize
    workloads.py  fixed-length random prompts, shared-prompt n>1, a JSONL dataset
    texts.py      the text workloads (W6 code edit, W7 quoting summary) on stdlib text
    spec_metrics.py  speculative decoding's counters from /metrics, acceptance rate
    runner.py     Poisson arrivals under a concurrency cap, with a progress bar
    metrics.py    throughput and TTFT / TPOT / ITL / E2E percentiles
    report.py     the printed table, the JSON file, `--compare A.json B.json`
    plots.py      latency CDFs and throughput over time (matplotlib, the `plot` extra)
    cli.py        the `plait bench` options

Nothing here imports the engine or the HTTP server: the client only speaks HTTP, so it
measures Plait and any other server the same way. Importing this package is cheap (httpx
and matplotlib load when a run starts).
"""
