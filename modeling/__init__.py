"""The policy's building blocks, below model.py: the decoder layers as HF computes them (layers.py), the KV cache of
batched generation with per-row lengths and tree layouts (kv_cache.py), and bf16 training with fp32 master weights
(mixed_precision.py).

May import: parallel/, branch_mask.py. Imported by model.py, draft.py and everything above them.
"""
