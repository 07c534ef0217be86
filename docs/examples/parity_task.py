"""A task in one file: the parity of 6 bits.  python train.py --task=docs.examples.parity_task:ParityTask"""
import random

import torch

from tasks.task import Tokenizer

BITS = [format(i, "06b") for i in range(64)]  # every problem; the multiples of 7 are held out for eval


class ParityTask:  # tasks/protocol.py: a Task, with Demonstrations for the SFT warm-up
    def __init__(self, cfg):  # --task=module:factory calls factory(cfg); here the factory is the class
        self.tok, self.max_new_tokens = Tokenizer(("<pad>", "<bos>", "<eos>", "0", "1", "=")), 2  # answer, <eos>

    def sample(self, k, rng, split="train"):
        return rng.choices([p for p in BITS if (int(p, 2) % 7 == 0) == (split == "eval")], k=k)

    def eval_set(self, k, seed=1234):
        return self.sample(k, random.Random(seed), "eval")

    def encode_prompt(self, p):  # <bos> 0 1 1 0 1 0 =
        return torch.tensor([self.tok.bos_id] + self.tok.encode(p + "="))

    def encode_demo(self, p, rng):  # (prompt + answer + <eos>, prompt length)
        return torch.cat([self.encode_prompt(p), torch.tensor(self.answer(p))]), len(p) + 2

    def answer(self, p):  # the one right response: the parity bit, then <eos>
        return self.tok.encode(str(p.count("1") % 2)) + [self.tok.eos_id]

    def score(self, problems, responses):  # (rewards (B,), {"correct": (B,)})
        R = torch.tensor([float(r.tolist() == self.answer(p)) for p, r in zip(problems, responses)])
        return R, {"correct": R}

    def fingerprint(self):  # what shapes prompts, demonstrations and rewards (the warm-ups' cache keys)
        return {"task": "parity", "bits": 6, "eval": "multiples of 7"}
