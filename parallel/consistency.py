"""Checks that turn silent wrong answers into errors: ranks that disagree on the batch, and non-finite inputs.

1. Same cu_seqlens on every CP rank. ring_branch_attention takes the *global* packed boundaries on every rank of the
   CP group; a rank with other boundaries computes garbage without a word (an error of 1.64 against dense in the issue's
   test), because each rank only sees its own shard. Checking inside the ring would put a host sync into every
   attention call. Instead, once per step, every rank hashes all the step's boundaries into one int64 fingerprint

       f = sum_i w_i * x_i  (mod 2^64, int64 wrap-around),   x = concat over micro-batches of (len(cu), cu...)

   with fixed pseudo-random odd weights w_i, and one all_gather of that 8-byte number per rank compares them. Cost
   per step: hashing O(S) ints on the host, one tiny collective (cp * 8 bytes) and one host sync (reading the
   result); nothing inside the ring. Measured on gloo, 2-4 processes sharing 2 CPU cores: hash 0.1-1.2 ms, hash +
   collective + check 1-11 ms per step (S = 64..1024 sequences, 2..8 micro-batches; bench/bench_consistency.py),
   against training steps of seconds. On NCCL it is one latency-bound 8-byte all_gather (not measured here). A
   change at a single position always changes f (w_i is odd, so d * w_i = 0 mod 2^64 needs d = 0 mod 2^64); other
   changes collide with probability about 2^-64.
2. The same weights on every rank after a refit. Every rank rolls out with its own full copy of the policy and the
   drafts; a copy that missed an update (a draft buffer left on storage the optimizer no longer writes) samples from
   another policy than its peers, silently. check_same_weights compares, once per refit, one int64 per model:

       f = sum_j w_j * sum_i bits(x_ji)  (mod 2^64),   bits: a tensor's elements read as integers of their width

   The inner sums are exact integer sums, so any device, kernel or reduction order gives the same number; a changed
   element always changes f, a permutation inside one tensor does not (no copy of a weight is needed, so it stays a
   read of the weights, about 3 ms per 8 GB at GPU bandwidth; not measured on a GPU). One all_gather of 8 bytes per
   model and one host sync per refit.
3. Finite attention inputs. NaN or inf in q, k or v turns whole rows into NaN with no word. check_finite names the
   tensor, how many values and the first bad row; it reads the tensor back (a host sync), so it is for debug runs.

    python -m parallel.consistency                        # fingerprints of a few boundary lists; a NaN caught by name
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.waits import backend_of

_W = None  # the fixed weights, made once (same on every rank: seeded, on the CPU)


def _weights(n: int) -> torch.Tensor:
    global _W
    if _W is None or _W.numel() < n:
        g = torch.Generator().manual_seed(0x5EED)
        _W = torch.randint(1, 2 ** 62, (max(n, 4096),), generator=g, dtype=torch.int64) | 1  # odd, so never 0
    return _W[:n]


def fingerprint(cu_seqlens_list) -> torch.Tensor:
    """One int64 (a 0-dim CPU tensor) for an ordered list of cu_seqlens tensors (the step's micro-batches)."""
    parts = []
    for cu in cu_seqlens_list:
        cu = cu.detach().to("cpu", torch.int64).reshape(-1)  # host copy of S+1 ints per micro-batch: tiny
        parts += [torch.tensor([cu.numel()]), cu]
    x = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.int64)
    return (x * _weights(x.numel())).sum()  # int64 products and sum wrap around identically on every rank


def check_same_cu_seqlens(cu_seqlens_list, group=None, what: str = "cu_seqlens") -> None:
    """Collective over `group` (every rank calls it, once per step): raise on EVERY rank if any rank's boundaries
    differ, naming the ranks that disagree with rank 0 of the group. group=None or a group of one: no-op.

    `cu_seqlens_list`: the step's micro-batch cu_seqlens, in order (one tensor is fine too). The 8-byte fingerprint
    travels on the CPU wherever the group runs CPU tensors (gloo; on a GPU node's "cpu:gloo,cuda:nccl" groups too, so
    the check never waits for the GPU's stream), else (a group of NCCL only) on this process's current CUDA device."""
    if isinstance(cu_seqlens_list, torch.Tensor):
        cu_seqlens_list = [cu_seqlens_list]
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    f = fingerprint(cu_seqlens_list)
    dev = "cpu" if backend_of(group, "cpu") else torch.device("cuda", torch.cuda.current_device())
    everyone = [torch.empty((), dtype=torch.int64, device=dev) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, f.to(dev), group=group)
    got = [int(x) for x in everyone]  # the one host sync
    odd = [r for r, x in enumerate(got) if x != got[0]]
    if odd:
        me = dist.get_rank(group)
        raise ValueError(f"{what} differ across the CP group: group rank(s) {odd} disagree with group rank 0 "
                         f"(this is group rank {me}, fingerprint {got[me]:#x}). Every rank of a CP group must pass "
                         "the same global, CP-padded boundaries (and the same micro-batches in the same order)")


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element width -> the integers it reads as


def weights_fingerprint(tensors) -> torch.Tensor:
    """One int64 (a 0-dim tensor on the tensors' device) for an ordered list of tensors, from their bit patterns."""
    tensors = list(tensors)
    dev = tensors[0].device if tensors else torch.device("cpu")
    w = _weights(max(len(tensors), 1)).to(dev)
    f = torch.zeros((), dtype=torch.int64, device=dev)
    for j, t in enumerate(tensors):
        bits = t.detach().reshape(-1).view(_INT[t.element_size()])  # the same bytes as integers: no copy
        f += bits.sum(dtype=torch.int64) * w[j]  # exact: integer sums wrap around identically everywhere
    return f


def check_same_weights(parts: dict, group=None) -> dict:
    """Collective over `group` (None: the world; every rank calls it): {name: tensors} -> {name: fingerprint (int)},
    after raising on EVERY rank if any rank's fingerprint of a part differs from rank 0's, naming the part and the
    ranks. One process: the fingerprints, nothing compared."""
    names = list(parts)
    f = torch.stack([weights_fingerprint(parts[n]) for n in names])  # (P,) on the weights' device
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n > 1:  # the tensors' device picks the backend of a "cpu:gloo,cuda:nccl" group
        everyone = [torch.empty_like(f) for _ in range(n)]
        dist.all_gather(everyone, f, group=group)
        got = torch.stack(everyone).cpu()  # (n, P): the one host sync
        odd = {name: [r for r in range(n) if got[r, j] != got[0, j]] for j, name in enumerate(names)}
        odd = {name: ranks for name, ranks in odd.items() if ranks}
        if odd:
            what = "; ".join(f"{name}: rank(s) {ranks}" for name, ranks in odd.items())
            raise ValueError(f"the ranks' copies differ from rank 0's after the refit ({what}): every rank must roll "
                             "out with the same weights; a tensor held beside a parameter kept an old copy")
        f = got[0]
    return {name: int(x) for name, x in zip(names, f.tolist())}


def check_finite(where: str = "attention input", **tensors) -> None:
    """Raise FloatingPointError naming the first tensor (by keyword) that holds NaN or inf: how many values, and the
    first bad index along dim 0 (the row). None values are skipped. One host sync per tensor: debug runs only."""
    for name, x in tensors.items():
        if x is None:
            continue
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            n = int(bad.sum())
            row = int(bad.reshape(x.shape[0], -1).any(1).nonzero()[0]) if x.dim() else 0
            kinds = [k for k, m in (("nan", torch.isnan(x)), ("inf", torch.isinf(x))) if bool(m.any())]
            raise FloatingPointError(f"{where} {name} {tuple(x.shape)}: {n} non-finite value(s) ({'/'.join(kinds)}), "
                                     f"first in row {row}")


if __name__ == "__main__":
    from parallel.cli import answer_help
    answer_help(__doc__, __file__)  # -h / --help: usage and summary from the docstring, exit 0
    a = torch.tensor([0, 8, 12], dtype=torch.int32)
    cases = ([a], [a.long()], [a, a], [a + 0 * a + (a > 8) * 4])
    print("fingerprints:", [hex(int(fingerprint(c)) % 2 ** 64) for c in cases])
    q = torch.randn(6, 2, 4)
    q[3, 1, 0] = float("nan")
    try:
        check_finite("ring_branch_attention", q=q, k=torch.randn(6, 1, 4))
    except FloatingPointError as e:
        print("caught:", e)
