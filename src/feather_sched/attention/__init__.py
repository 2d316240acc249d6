"""Shared-prefix decode attention: each prefix group's KV read once per step.

Engine-agnostic: ``groups`` finds the decode rows of a step that share leading KV blocks
(or, in a token table such as SGLang's ``req_to_token``, leading KV slots) and plans the
step (one segment per group's prefix, one per row's suffix, and the shortened rows the
engine's own kernel attends instead); ``partials`` merges partial attentions exactly by
log-sum-exp and holds the float64 reference; the kernels (``cpu_kernel`` for vLLM's CPU
cache layouts and token-major pools, ``triton_kernels`` for paged GPU caches, their
Triton source in ``triton_jit``) compute the segments, ``eligibility`` says which layers
they serve (one rule each adapter translates its engine's layer into), ``gpu_decode``
runs them with launches fixed for an engine's life (so CUDA graphs can capture them);
``selfcheck`` measures the path against an engine's own kernel (exactness,
then speed over a grid) for the verdict ``auto`` takes, ``gpu_check`` its batches in
vLLM's GPU layout and its subject where no engine is installed. Engine adapters
(``integrations.vllm.attention``, ``integrations.vllm.attention_gpu``,
``integrations.sglang.attention``) translate the engine's cache layouts and metadata and
decide where in that engine the path may run (which layers, which batches); the grouping
and the kernels live here.
"""
