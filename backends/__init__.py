"""Compute backends: the same computations as the root files, on other kernels. The block computation of
attention_cp.py on Triton (attention_triton*.py) and flash-attn (attention_flash.py), selected with
`ring_branch_attention(..., backend=)` / `--attn_backend`; dense padded attention for one process
(attention_padded.py); log-probs of chosen tokens streamed from the final hidden state through the LM head in chunks
(fused_logprob.py). Each is tested against the reference it replaces.

May import: parallel/, branch_mask.py, modeling/, decoding/, model.py, attention_cp.py.
"""
