"""Decoding support for speculative.py: the exact accept / residual rule of speculative sampling, shared by chains and
trees (spec_rule.py), lossless tree drafts, several candidates per position verified in one forward
(speculative_tree.py), the draft's side of a call (draft_trunk.py: its cache, its state, the entries waiting after
k = 0 steps), and the controllers that speculative.generate asks for each step's k (k_control.py: a fixed k, a fixed
cycle; adaptive_k.py: k chosen per step from measured costs and acceptance).

May import: parallel/, branch_mask.py, modeling/. Imported by speculative.py and the harness.
"""
