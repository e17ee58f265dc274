"""Sizing: how much VRAM a model needs on each GPU, for which engine, and the engine flag that
keeps it inside vramsched's reservation. Pure except `checkpoint` (reads a local model
directory); docs/sizing.md explains the math and its sources.

Modules: architecture (config.json -> shape), tensors (the tensor inventory), quant (bytes per
weight format), kv (KV cache), engines (per-engine overhead and flag semantics), engine_args
(an engine's flags from a container spec), gpus (GPU products and MIG slices), catalogue
(models known by name), checkpoint (a local directory), estimate (the whole answer), handoff
(the bind-time fraction annotation).
"""
