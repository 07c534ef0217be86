"""Decoding support for speculative.py: the exact accept / residual rule of speculative sampling, shared by chains and
trees (spec_rule.py), and lossless tree drafts, several candidates per position verified in one forward
(speculative_tree.py).

May import: parallel/, branch_mask.py, modeling/. Imported by speculative.py and the harness.
"""
