"""What the lab's models share: reading checkpoints, the hub, the KV cache, sampling, the generation
loop and the run summary. gpt2/ and llama/ each keep their own config, weights' names, tokenizer
and forward pass, and use these.

Modules: errors (the user's errors: one line, exit 2), checkpoint (safetensors files, one or sharded
with model.safetensors.index.json; the hub download), arrays (NumPy or CuPy, the weights' dtype),
kv_cache, generate (Sampler, the eager generation loop, the decode rung), summary (lab.py's report).

A model's config gives the shared code `n_layer`, `n_head`, `kv_heads`, `head_size`, `n_positions`
and `vocab_size`; its forward is `forward(params, config, idx, attend, *, cache=None, last_only=False)`.
"""
