"""Host side of the ops: which kernel runs (``select``, on the measured records of ``arch``),
running it (``execute``), the launchers (``cuda_infer``, ``cuda_decode``, ``cuda_train``,
``cpu_ffn``, ``torch_impl``) and the per-layer state they keep (``density``, ``decode_state``,
``decode_graphs``, ``launch``). Importing it initialises no device and imports no Triton."""
