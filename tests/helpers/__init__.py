"""What the tests share, imported as `helpers` (pytest's pythonpath is tests/):

    engine        the engine driver: make_llm, solo, run_until_done, tokens_of, pool checks
    model         a model built as the runner builds it, driven over a hand-written paged cache
    tiny_model    a tiny random-weight checkpoint on the default model's tokenizer
    kernel_cases  attention batches and dense references for the kernel tests
    quant_cases   random GGUF weights and a strided qgemm call for the quant kernel tests
    server        real `plait serve` processes (plait/bench/launch.py), in-process uvicorn, SSE
    scripted      a scripted engine core whose steps the test can hold and release
    requests      chat / completion request bodies
    kv_events     a router's side of the KV-cache events (SUB socket, block index)
    responses, tools, browser, deploy     what the Responses, tool, /ui and deploy tests share
    paths         REPO, SCRIPTS, TESTS, run_python
    triton_interpret_worker               run as a module by tests/kernels/test_kernels_triton.py
"""
