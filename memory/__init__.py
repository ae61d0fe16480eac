"""Memory policy: resources, estimates from safetensors headers, the VRAM plan, block swap, chunked VAE decode
and OOM learning (learned limits live in the limit cache, namespace ``memory``).

Importing this package is cheap (no torch); import the submodules you need:

- ``system``          SystemInfo, detect_system()
- ``weights``         safetensors header reading, per-block byte tables, preset shape tables
- ``estimate``        Workload and activation / KV cache / VAE estimates
- ``plan``            MemoryPlan, make_plan()
- ``limits``          keys and readers of learned limits
- ``oom``             is_oom(), free_memory(), oom_retry(), run_chunks()
- ``block_swap``      BlockSwap, apply_block_swap(), ensure_block_swap(), run_with_swap_fallback()
- ``chunked_decode``  decode_chunked(), min_chunk()
- ``bench``           ``python -m wan_accel bench offload``
"""
