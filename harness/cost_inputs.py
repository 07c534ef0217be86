"""The cost model's inputs (harness/cost_model.py has the model): the policy's and the draft's sizes, their FLOPs and
bytes per call, and the device figures.

    Arch.load("mini") / Arch.load("path/config.json" or a checkpoint directory)   the policy's sizes
    Arch.draft_of(policy, taps=3, vocab=0)                                        its EAGLE-3 draft's sizes
    Device.load("bench/results/cost_device_cpu.json" or a preset name)            the device figures

FLOPs (a multiply-add = 2), per token, the paper's way. One decoder layer of the policy (H hidden, n_q / n_kv heads of
d dims, I intermediate), a token attending to c keys:

    P_layer = H (n_q d) + 2 H (n_kv d) + (n_q d) H + 3 H I             (q, k, v, o; gate, up, down)
    flops_layer(c) = 2 P_layer + 4 n_q d c                             (weights; scores q.k and p.v)
    flops_head = 2 H V                                                 (the LM head, at each position it is needed)

The EAGLE-3 draft (one decoder layer whose q, k, v read [norm(e); norm(h)], 2H wide; fc over the taps; its head over
the reduced vocabulary V_d): P_dlayer = 2H (n_q d + 2 n_kv d) + (n_q d) H + 3 H I, P_fc = n_taps H H, and per token
per draft forward 2 P_dlayer + 4 n_q d c + 2 H V_d (+ 2 P_fc where the taps enter: the trunk, not a draft step).

Bytes of a decode call (memory-bound at small batch): the weights once, b_w bytes each, plus the KV cache read:
B rows x c keys x 2 n_kv d values x b_kv bytes per layer.

Device figures (every one named; where they come from is the device file's business -- bench/probe_cost.py measures
this CPU's; the GPU presets state their sources and assumptions):
    F             FLOP/s reached on the model's matmuls (peak x efficiency on a GPU); F_train the update's and TTT's;
                  F_attn their packed attention's (per-sequence blocks: small matmuls, far below F on a CPU);
                  F_pad the reference log-probs' attention, padded to the block's longest row and computed over the
                  full square (0: a varlen kernel, no padding, at F)
    BW            bytes/s of memory
    bytes         bytes per weight / KV value (4 fp32, 2 bf16)
    o_*           fixed seconds per call (docs in bench/probe_cost.py); 0 where a device has none worth counting
    cores         processes that run at full speed at once (CPU cores; GPUs: one process each)
    oversub       the CPU-time inflation when processes outnumber cores (time slices refill caches); 1 on GPUs
    o_comm, BW_comm   per exchange or collective, and bytes/s, of one rank's communication (harness/cost_comm.py;
                  bench/probe_cost_comm.py measures this CPU's over gloo)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace

OVERHEADS = ("o_layer", "o_seq", "o_layer_fb", "o_seq_fb", "o_layer_pad", "o_ref", "o_dec", "o_step", "o_vstep",
             "o_dstep", "o_dext", "o_pass1", "o_pass1_seq", "o_pass1_tok", "o_pass", "o_pass_seq", "o_pass_tok",
             "o_row", "o_upd", "o_tok_fb", "o_dopt",  # these four: the host's work around the calls
             "o_comm")  # per exchange or collective of one rank (harness/cost_comm.py)
HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE_FILES = {  # preset name -> file, relative to the checkout
    "cpu": "bench/results/cost_device_cpu.json",
    "h100": "docs/examples/cost_device_h100.json",
}


@dataclass
class Arch:
    """A decoder stack's sizes (a policy, or a draft's one layer with its fc and head: `draft` True)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft: bool = False
    taps: int = 0  # the draft's fc input: taps x hidden
    tied: bool = False  # the LM head is the embedding (counted once in the weights)

    @classmethod
    def load(cls, spec: str) -> "Arch":
        """A model.ModelConfig preset name, an HF config.json, or a directory holding one; checked by model.ModelConfig
        (heads >= 1, hidden a multiple of the heads, ...: the same checks as every other reader of a config)."""
        from model import PRESETS, ModelConfig
        from serving.hf_io import read_json
        if spec in PRESETS:
            return cls.of(PRESETS[spec])
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(path):
            raise ValueError(f"--model={spec!r}: expected a model preset ({', '.join(sorted(PRESETS))}), an HF "
                             "config.json or a directory holding one")
        c = read_json(path)
        need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
        missing = [k for k in need if k not in c]
        if missing:
            raise ValueError(f"{path}: missing key(s) {missing} (an HF decoder config needs {', '.join(need)})")
        try:  # the sizes only: the cost model does not care about RoPE variants or the architecture's name
            return cls.of(ModelConfig(**{k: c[k] for k in need}, head_dim=c.get("head_dim"),
                                      num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                                      tie_word_embeddings=bool(c.get("tie_word_embeddings", False))))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def of(cls, c) -> "Arch":
        """The sizes of a (checked) model.ModelConfig."""
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                   c.intermediate_size, c.vocab_size, tied=c.tie_word_embeddings)

    @classmethod
    def draft_of(cls, policy: "Arch", taps: int = 3, vocab: int = 0) -> "Arch":
        """EAGLE-3's draft for `policy`: one layer of its widths, fc over `taps` taps, head over `vocab` (0: V)."""
        return replace(policy, layers=1, draft=True, taps=taps, vocab=vocab or policy.vocab, tied=False)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:  # P_layer (P_dlayer for a draft: q, k, v read 2H)
        qkv_in = 2 * self.hidden if self.draft else self.hidden
        return qkv_in * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """Every weight: the layers, the head (and the policy's embedding unless tied; the draft shares the policy's),
        the draft's fc."""
        head = self.hidden * self.vocab
        emb = 0 if (self.draft or self.tied) else head
        return self.layers * self.layer_params + head + emb + self.taps * self.hidden * self.hidden


def layer_flops(a: Arch, tokens: float, ctx: float) -> float:
    """Forward FLOPs of ONE policy layer over `tokens` tokens, each attending to `ctx` keys on average."""
    return dense_flops(a, tokens) + attn_flops(a, tokens, ctx)


def dense_flops(a: Arch, tokens: float) -> float:
    """The weights' share of layer_flops: 2 P_layer per token."""
    return tokens * 2 * a.layer_params


def attn_flops(a: Arch, tokens: float, ctx: float) -> float:
    """The attention's share of layer_flops: q.k and p.v, 4 n_q d per token and key."""
    return tokens * 4 * a.q_dim * ctx


def pad_attn_flops(a: Arch, rows: float, longest: float) -> float:
    """Nominal FLOPs of one layer's attention over `rows` rows padded to `longest` tokens, the full square (a batched
    kernel over the padded grid): 4 n_q d B L_max^2. Its rate is F_pad, probed with the same count."""
    return 4 * a.q_dim * rows * longest ** 2


def head_flops(a: Arch, tokens: float) -> float:
    """Forward FLOPs of an LM head over `tokens` positions (the draft's: over its own vocabulary)."""
    return tokens * 2 * a.hidden * a.vocab


def draft_pass_flops(d: Arch, tokens: float, ctx: float, fc: bool) -> float:
    """Forward FLOPs of one draft forward over `tokens` entries: its layer, its head, and its fc where taps enter."""
    return layer_flops(d, tokens, ctx) + head_flops(d, tokens) + (tokens * 2 * d.taps * d.hidden ** 2 if fc else 0)


def layer_bytes(a: Arch, rows: float, ctx: float, wbytes: float, kvbytes: float) -> float:
    """Bytes one layer's decode call moves: its weights once, and `rows` rows' KV cache of `ctx` keys."""
    return a.layer_params * wbytes + rows * ctx * 2 * a.kv_dim * kvbytes


@dataclass
class Device:
    """Device figures: see the module docstring. Every field has a unit in its name or its comment."""
    name: str = "device"
    F: float = 1e12  # FLOP/s reached on the model's matmuls
    BW: float = 1e11  # bytes/s
    wbytes: float = 4  # bytes per weight (4 fp32, 2 bf16)
    kvbytes: float = 4  # bytes per KV-cache value
    F_train: float = 0.0  # FLOP/s of the update's and the TTT's matmuls (0: = F)
    F_attn: float = 0.0  # FLOP/s of the update's and the TTT's attention, per-sequence blocks (0: = F_train)
    F_pad: float = 0.0  # FLOP/s of the reference's attention padded to the block's longest row (0: not padded, at F)
    cores: float = 1  # processes that run at full speed at once
    oversub: float = 1.0  # CPU seconds per solo CPU second when more processes than cores share them (time slices)
    BW_comm: float = 0.0  # bytes/s one rank sends through the communication backend (0: transfers not counted)
    source: str = ""  # the command or the publication the figures come from, and the conditions
    overheads: dict = field(default_factory=dict)  # o_* seconds per call (bench/probe_cost.py names them)

    def o(self, name: str) -> float:
        if name not in OVERHEADS:
            raise KeyError(f"unknown overhead {name!r}: expected one of {', '.join(OVERHEADS)}")
        return float(self.overheads.get(name, 0.0))

    @property
    def Ft(self) -> float:
        return self.F_train or self.F

    @property
    def Fa(self) -> float:
        return self.F_attn or self.Ft

    @classmethod
    def load(cls, spec: str, root: str = os.path.dirname(HERE)) -> "Device":
        """A preset name (DEVICE_FILES) or a JSON file of Device's fields (unknown keys refused)."""
        path = os.path.join(root, DEVICE_FILES[spec]) if spec in DEVICE_FILES else spec
        if not os.path.isfile(path):
            raise ValueError(f"--device={spec!r}: expected a preset ({', '.join(DEVICE_FILES)}) or a device JSON "
                             "file (bench/probe_cost.py writes one)")
        from serving.hf_io import read_json
        d = read_json(path)
        names = {f.name for f in fields(cls)}
        bad = sorted(set(d) - names) + sorted(set(d.get("overheads", {})) - set(OVERHEADS))
        if bad:
            raise ValueError(f"{path}: unknown device field(s) {bad}: expected {sorted(names)}, overheads "
                             f"{list(OVERHEADS)}")
        try:
            dev = cls(**d)
            dev.check()
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        return dev

    def check(self):
        """Every figure a finite number in its range: F, BW, cores > 0; the bytes, rates and fixed overheads >= 0."""
        pos = ("F", "BW", "wbytes", "kvbytes", "cores")
        bad = [f"{k}={getattr(self, k)!r}: expected a number > 0" for k in pos if not _num(getattr(self, k), 0, False)]
        bad += [f"{k}={getattr(self, k)!r}: expected a number >= 0" for k in ("F_train", "F_attn", "F_pad", "BW_comm")
                if not _num(getattr(self, k), 0, True)]
        bad += [f"oversub={self.oversub!r}: expected a number >= 1"] * (not _num(self.oversub, 1, True))
        # a per-token or per-sequence term (`*_tok`, `*_seq`) is a slope fitted beside its pass's FLOP time (from
        # differences of timings, bench/probe_cost.py) and may come out below 0; the fixed overheads may not
        bad += [f"overheads.{k}={v!r}: expected seconds >= 0" for k, v in self.overheads.items()
                if not (_slope(k) and _num(v, -math.inf, False)) and not _num(v, 0, True)]
        if bad:
            raise ValueError("; ".join(bad))


def clamp_fixed(overheads: dict) -> tuple[dict, str]:
    """A probe's overheads with every fixed one below 0 set to 0, and a note naming them ("" if none). A fixed
    overhead is a residual (a timing less the FLOP time and the other terms): below 0 it is under the probe's noise.
    The slopes (`*_tok`, `*_seq`) stay as fitted."""
    low = {k: v for k, v in overheads.items() if not _slope(k) and v < 0}
    note = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in low.items())
    return {k: 0.0 if k in low else v for k, v in overheads.items()}, note and f"clamped to 0, below the noise: {note}"


def _slope(name: str) -> bool:
    return name.endswith(("_tok", "_seq"))


def _num(v, lo: float, closed: bool) -> bool:
    """v is a finite number (not a bool) above lo (or at it, closed)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (v >= lo if closed else v > lo)
