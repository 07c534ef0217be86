"""The GPU check's HF-mode run, its inputs and its verdict: a random Qwen3 checkpoint at the real vocabulary (a
word-level tokenizer of V ids with a `<mask>` token for the block drafters, nothing downloaded) with 100 addition
prompts, and the check of the run's summary.json.

    python bench/gpu_check_hf.py checkpoint DIR [--vocab 151936]   # DIR/qwen3 (4 layers, hidden 256) + prompts.jsonl
    python bench/gpu_check_hf.py summary RUN                         # RUN/summary.json: 2 steps, finite numbers

The summary check: steps == 2, and reward_last, kl_last, accept_len_cotrained, ar_tok_s finite -- kl_last may be null
only where the run held no reference model (HF mode's default: --beta 0, no KL log, no offline arm).
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.cli import parser, run_main  # noqa: E402

WORDS = "What is + ? 0 1 2 3 4 5 6 7 8 9".split()
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]  # <mask>: the block drafters' MASK
SUMMARY_KEYS = ("reward_last", "kl_last", "accept_len_cotrained", "ar_tok_s")


def write_checkpoint(work: str, V: int) -> str:
    """work/qwen3 (a random 4-layer Qwen3 at vocabulary V, tied head, its tokenizer) and work/prompts.jsonl."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    fill = [f"w{i}" for i in range(V - len(SPECIALS) - len(WORDS))]
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS + fill)}
    if len(vocab) != V:
        raise SystemExit(f"--vocab={V}: expected at least {len(SPECIALS) + len(WORDS)} ids")
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(SPECIALS)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = os.path.join(work, "qwen3")
    os.makedirs(path, exist_ok=True)
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "mask_token": "<mask>",
                   "add_bos_token": True}, f)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                   max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        for a in range(10):
            for b in range(10):
                f.write(json.dumps({"prompt": f"What is {a} + {b} ?", "answer": a + b}) + "\n")
    return path


def check_summary(run: str) -> dict:
    """The fields SUMMARY_KEYS of run/summary.json; SystemExit naming any that is null or not finite (kl_last may be
    null when the run's config held no reference model) or a step count other than 2."""
    with open(os.path.join(run, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(run, "config.json")) as f:
        c = json.load(f)
    hf = os.path.isdir(c["model"])  # HF mode: auto arms and the KL log are off (harness/config.py, Config.arm)
    ref = c["beta"] > 0 or c["log_kl"] is True or c["offline_arm"] is True or (c["log_kl"] == "auto" and not hf)
    nullable = set() if ref else {"kl_last"}
    bad = [k for k in SUMMARY_KEYS if not (s[k] is None and k in nullable)
           and not (s[k] is not None and math.isfinite(s[k]))]
    if s["steps"] != 2 or bad:
        raise SystemExit(f"{run}/summary.json: steps {s['steps']} (expected 2); null or not finite: {bad}")
    return dict({k: s[k] for k in ("steps",) + SUMMARY_KEYS}, null_allowed=sorted(nullable))


def main(argv):
    ap = parser(__doc__, __file__)
    ap.add_argument("what", choices=["checkpoint", "summary"], help="write the inputs, or check a run's summary")
    ap.add_argument("path", help="checkpoint: the work directory; summary: the run's --out")
    ap.add_argument("--vocab", type=int, default=151936, help="the checkpoint's vocabulary (Qwen3's by default)")
    a = ap.parse_args(argv)
    if a.what == "checkpoint":
        path = write_checkpoint(a.path, a.vocab)
        size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
        print(f"{path}: V = {a.vocab}, {size >> 20} MiB; {os.path.join(a.path, 'prompts.jsonl')}: 100 prompts")
    else:
        print(check_summary(a.path))
    return 0


if __name__ == "__main__":
    run_main(main, __file__, sys.argv[1:])
