"""Checkpoints in and out in the formats engines and HF use: HF checkpoint directories <-> model.Transformer
(hf_io.py), the co-trained draft exported as vLLM's / SGLang's EAGLE-3 checkpoint and the policy beside it
(export.py) and read back as carefully as an HF checkpoint (export_checks.py), and a reduced draft vocabulary
(draft_vocab.py).

May import: parallel/, tasks/, branch_mask.py, modeling/, decoding/, model.py, attention_cp.py, backends/.
"""
