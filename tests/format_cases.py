"""The draft families and formats the format tests share (tests/test_formats.py, tests/test_export_check_all.py): a
tiny draft of each family for a policy, and each (family, format, sub-folder of its export) cell."""
import torch

from draft import Eagle3Draft
from draft_dflash import DFlashDraft
from draft_dspark import DSparkDraft

FAMILIES = {
    "eagle3": lambda p: Eagle3Draft.from_target(p, draft_vocab=torch.arange(0, p.cfg.vocab_size, 2)),
    "dflash": lambda p: DFlashDraft.from_target(p, mask_token_id=0, block_size=4, num_layers=2),
    "dspark": lambda p: DSparkDraft.from_target(p, mask_token_id=0, block_size=4, num_layers=2, markov_rank=4),
}
CELLS = [("eagle3", "vllm", "."), ("eagle3", "speculators", "speculators"), ("dflash", "vllm", "."),
         ("dflash", "speculators", "speculators"), ("dspark", "speculators", ".")]  # what draft.export writes
