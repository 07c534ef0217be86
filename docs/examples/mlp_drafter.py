"""A draft family in one file: an MLP speculator (IBM's idea, one MLP step tied across positions). From the policy's
last hidden state h and the token just sampled, s_1 = norm(gelu(A h + B e(y))), then s_j from s_{j-1} and d_{j-1};
d_j ~ softmax(W_head s_j) through the policy's own LM head (shared, detached). No KV cache: the state is one vector.

    drafters.register("mlp", drafters.Family(MLPDraft, (), ()))     # then make_trainer("mlp", ...), --drafter=mlp
"""
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from draft_ttt import position_metrics
from drafter import propose_chain
from model import Transformer
from serving.draft_checkpoint import read_draft, write_draft


@dataclass
class MLPConfig:
    vocab_size: int
    hidden_size: int
    tap_layers: tuple  # (the policy's last layer,)
    target_num_layers: int  # the policy's (generate checks the draft matches its policy)


class NoCache:  # what decoding/draft_trunk.py asks of a draft's cache, for a draft that keeps no history
    def __init__(self, batch: int, device):
        self.lengths, self.bound = torch.zeros(batch, dtype=torch.long, device=device), 0

    def keep_rows(self, rows):
        self.lengths = self.lengths[rows]

    def rollback(self, lengths, bound=None):
        self.lengths = lengths

    def allocated_bytes(self) -> int:
        return 0


class MLPDraft(nn.Module):
    kind, architecture, max_draft_tokens, depth = "chain", "CospecMLPDraft", None, 3  # depth: positions trained
    taps_rule = "the policy's last layer"

    def __init__(self, cfg: MLPConfig, policy):
        super().__init__()
        self.cfg, H = cfg, cfg.hidden_size
        self.state_in, self.token_in, self.norm = nn.Linear(H, H, bias=False), nn.Linear(H, H), nn.LayerNorm(H)
        self.attach(policy)

    def attach(self, policy):  # the policy's embedding and LM head, detached (no gradient reaches the policy)
        self.register_buffer("embed_weight", policy.embed.weight.detach(), persistent=False)
        self.register_buffer("head_weight", policy.head_weight.detach(), persistent=False)

    @classmethod
    def from_target(cls, policy, *, tap_layers=None):
        c, p = policy.cfg, next(policy.parameters())
        taps = tuple(tap_layers or cls.default_taps(c.num_hidden_layers, None))
        cfg = MLPConfig(c.vocab_size, c.hidden_size, taps, c.num_hidden_layers)
        draft = cls(cfg, policy).to(device=p.device, dtype=p.dtype)
        draft.attach(policy)  # .to() may have copied the shared buffers
        with torch.no_grad():
            draft.norm.weight.copy_(policy.model.norm.weight)  # the policy's logit scale from the start
        return draft

    @property
    def tap_layers(self) -> tuple:
        return self.cfg.tap_layers

    def fresh(self, policy):
        return type(self).from_target(policy, tap_layers=self.tap_layers)

    def step(self, tokens, s):  # tokens (b,), s (b, H) -> the next state (b, H) and its logits (b, V)
        s = self.norm(F.gelu(self.state_in(s) + self.token_in(F.embedding(tokens, self.embed_weight))))
        return s, s @ self.head_weight.T

    # -- inference (drafter.py): the state at each row's last verified entry, then one step per drafted token -----
    def new_cache(self, batch: int, max_len: int, block: int = None):
        return NoCache(batch, self.head_weight.device)

    def extend(self, cache, tokens, taps: dict, last):  # tokens (b, N), taps {layer: (b, N, H)}, last (b,)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self.step(tokens[rows, last], taps[self.tap_layers[0]][rows, last].to(self.norm.weight.dtype))

    def propose(self, cache, state, k: int, temperature: float, generator=None):
        return propose_chain(self.step, *state, k, temperature, generator)

    # -- training: teacher-forced, position i's state stepped over x_{i+1..i+depth} against the policy's p ---------
    def loss(self, taps: dict, tokens, cu_seqlens, teacher_logits=None, *, loss_mask=None, teacher_hidden=None,
             teacher_head=None, **kw):  # single process (no CP): a position's next tokens are on this rank
        if teacher_logits is None:
            teacher_logits = teacher_hidden @ teacher_head.T  # (T, V)
        T, dev = tokens.shape[0], tokens.device
        i, end = torch.arange(T, device=dev), torch.repeat_interleave(cu_seqlens[1:], cu_seqlens.diff()).to(dev)
        s, total, stats, counts = taps[self.tap_layers[0]].to(self.norm.weight.dtype), 0, [], []
        agreed = torch.ones(T, dtype=torch.bool, device=dev)  # every earlier position agreed with the policy
        for j in range(1, self.depth + 1):
            t = (i + j).clamp(max=T - 1)
            valid = (i + j < end) & (True if loss_mask is None else loss_mask[t])
            s, z = self.step(tokens[t], s)  # predicts x_{i+j+1}, as the policy at i+j does
            p, logq = teacher_logits[t].float().softmax(-1), z.float().log_softmax(-1)
            ce, agree = -(p * logq).sum(-1), z.argmax(-1) == teacher_logits[t].argmax(-1)
            total = total + (ce * valid).sum() / valid.sum().clamp_min(1)
            alpha = torch.minimum(p, logq.exp()).sum(-1)
            stats.append(torch.stack([(x.float() * valid).sum() for x in (ce, agree, agree & agreed, agreed, alpha)]))
            counts.append(valid.sum())
            agreed = agreed & agree
        return total, position_metrics(torch.stack(stats).detach(), torch.stack(counts))

    @staticmethod
    def loss_options(trainer) -> dict:
        return {}

    # -- checkpoints; no serving engine loads this family ----------------------------------------------------------
    def save(self, path: str):
        write_draft(path, dict(asdict(self.cfg), tap_layers=list(self.tap_layers),
                               architectures=[self.architecture]), self.state_dict())

    @classmethod
    def load(cls, path: str, policy):
        raw, sd = read_draft(path, cls.architecture)
        draft = cls(MLPConfig(**raw), policy).to(device=policy.embed.weight.device, dtype=sd["norm.weight"].dtype)
        draft.load_state_dict(sd)
        draft.attach(policy)
        return draft

    def check_exportable(self):
        raise ValueError("an MLP draft has no serving format (save() keeps it)")

    def export(self, path: str, **kw):
        self.check_exportable()

    # -- the family's facts (drafter.FAMILY) ----------------------------------------------------------------------
    config_class = staticmethod(lambda: MLPConfig)
    default_taps = staticmethod(lambda n_layers, cfg: (n_layers - 1,))
    taps_ok = staticmethod(lambda taps, n_layers: taps == (n_layers - 1,))
    cache_shape = staticmethod(lambda cfg: (0, 0))  # no KV cache
    size_flags = staticmethod(lambda cfg: "")  # sized by the policy alone

    @classmethod
    def of_shape(cls, m, cfg, taps):
        return cls.from_target(Transformer(m), tap_layers=taps)

    @classmethod
    def act_bytes(cls, size, cfg, T, n_taps, seqs):  # per position and step: ~6 H-wide tensors, 3 fp32 (V,) rows
        return T * cls.depth * (6 * size.H * size.b + 12 * size.m.vocab_size)

    @staticmethod
    def check_file(path, fmt):  # --draft in a served format: there is none
        raise ValueError(f"--draft {path!r}: an MLP draft has no {fmt} format")

    @staticmethod
    def from_fields(fields, sd, path, n_layers):
        raise ValueError(f"--draft {path!r}: an MLP draft has no served format")
