"""Plait's inference engine: config, KV block pool, scheduler, model runner, sampler.

The engine path never imports fastapi or pydantic, so it runs on machines that only have
torch (and optionally triton and transformers).
"""
