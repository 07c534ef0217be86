"""Decoding support for speculative.py: the exact accept / residual rule of speculative sampling, shared by chains and
trees (spec_rule.py), lossless tree drafts, several candidates per position verified in one forward
(speculative_tree.py), and the adaptive number of draft tokens, k chosen per step from measured costs and acceptance
(adaptive_k.py).

May import: parallel/, branch_mask.py, modeling/. Imported by speculative.py and the harness.
"""
