"""Checkpoints in and out in the formats engines and HF use: HF checkpoint directories <-> model.Transformer
(hf_io.py), the co-trained draft exported as vLLM's / SGLang's EAGLE-3 checkpoint and the policy beside it
(export.py) and read back as carefully as an HF checkpoint (export_checks.py), a draft family's own checkpoint (its
save and load: draft_checkpoint.py), and a reduced draft vocabulary (draft_vocab.py); vLLM as a rollout engine
(vllm_engine.py, the client; vllm_worker.py, the one file that imports vLLM, run in vLLM's own environment), its refit
checksum (weight_sum.py) and the checks its samples must pass first: losslessness, refits that landed
(engine_check.py).

May import: parallel/, tasks/, branch_mask.py, modeling/, decoding/, model.py, attention_cp.py, backends/.
"""
