"""Shared pieces of the block-drafter tests (test_dflash.py, test_dspark.py, test_dflash_cp.py)."""
from attention_cp import reference_anchor_attention


def oracle(q, k, v, cu, anchors, bk, bv, *, anchor_visible, group, softmax_scale, backend):
    """attention_cp's dense oracle in the block forward's attention place (one process: local rows are global)."""
    return reference_anchor_attention(q, k, v, cu, anchors, bk, bv, anchor_visible=anchor_visible,
                                      softmax_scale=softmax_scale)[0]
