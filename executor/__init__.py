"""foldtune executor: the real MoE training step under a folded layout, on torch alone.

Layout of the package (one concept per module):
- ``model`` (MoEGPT, DecoderLayer), ``attention``, ``attention_core`` (sliding windows and attention sinks on
  a mask), ``mlp`` (dense / shared-expert gated MLP), ``activation`` (SwiGLU or GPT-OSS's clamped quick-GeGLU),
  ``moe`` (MoELayer, GroupedExperts), ``router`` (top-k rules, aux/z losses, expert bias, capacity), ``dispatcher`` (alltoall and
  allgather token dispatchers, loop-free permutation).
- ``parallel``: ``groups`` (ParallelState built from spec.rank_groups.FoldedGroups), ``collectives``
  (autograd collectives), ``tensor_parallel`` (SP enter/leave, layout checks), ``vocab`` (vocab-parallel
  embedding and cross-entropy), ``linear_cross_entropy`` (output layer and loss fused, in vocabulary blocks),
  ``sharding`` (ShardInfo per parameter, deterministic full-size init, gather back),
  ``grad_reduce`` (bucketed TP/DP/EDP gradient reduction).
- ``kernels``: the kernel interface (torch backend; fused Triton permutation on CUDA).
- ``train_step`` (Trainer: micro-batches, reduction, AdamW, expert bias), ``data`` (synthetic batches),
  ``timing`` (phase markers), ``measurement`` (Measurement), ``profile`` (profile_layout), ``launch_local``
  (one process per rank), ``verify`` (equivalence with the single-process reference).
"""
