"""No host sync inside a ring step: a guard that counts every read of a tensor's values into Python (.item(),
.tolist(), bool(), int(), float(), .numpy() -- on a GPU each one waits for the stream) made by a thread while it is
inside ring_branch_attention's forward or backward, or cp_shift. On CPU every tensor stands in for a device tensor,
so the count is exact: zero once the layout's host copy exists (host_cu, carried with cu_seqlens by cu_to) and the
per-layout tables are cached (the first call of a layout builds them; the loop over layers and steps reuses them)."""
import contextlib
import threading
import traceback

import pytest
import torch

from attention_cases import make_case
from attention_cp import ring_branch_attention
from branch_mask import cp_shift, cu_to, host_cu, zigzag_shard
from parallel.ring import run_ranks

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")


class HostReads:
    """Counts value reads per call site while `active()` is entered in the current thread (other threads too may
    enter it: the ranks of run_ranks)."""

    def __init__(self):
        self.sites, self._inside, self._lock = [], threading.local(), threading.Lock()

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)

    def _wrap(self, name, fn):
        def read(t, *args, **kw):
            if getattr(self._inside, "on", False):
                with self._lock:
                    self.sites.append(f"{name}: " + traceback.format_stack(limit=3)[0].strip())
            return fn(t, *args, **kw)
        return read

    @contextlib.contextmanager
    def active(self):
        self._inside.on = True
        try:
            yield
        finally:
            self._inside.on = False


def test_the_guard_counts_reads():  # the control: the old code's host copy of the boundaries is a counted read
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with HostReads() as reads:
        with reads.active():
            (cu // 2).tolist()
            bool((cu > 0).any())
        cu.tolist()  # outside the region: not counted
    assert len(reads.sites) == 2, reads.sites


def _rank_fn(case, reads, calls):
    cu = case["cu"]

    def rank(ring):
        shard = lambda x: zigzag_shard(x, cu, case["cp"], ring.rank)  # noqa: E731
        ins = [shard(case[n]).requires_grad_() for n in ("q", "k", "v", "bk", "bv")]
        dout, dlse = shard(case["dout"]), shard(case["dlse"])  # the test's own sharding: outside the region
        for i in range(calls):  # a forward over `calls` layers: the first may build the layout's tables
            with reads.active() if i == calls - 1 else contextlib.nullcontext():
                out, lse = ring_branch_attention(*ins[:3], cu, *ins[3:], group=ring, return_lse=True,
                                                 backend=case["backend"])
                ((out * dout).sum() + (lse * dlse).sum()).backward()
        return True
    return rank


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_no_host_reads_in_the_torch_ring(cp):
    """backend "torch" keeps no tables: zero reads from the first call, given the carried host copy."""
    case = make_case([13, 5, 20], cp, P=2, Hkv=2, G=2, D=8, seed=cp, backend="torch_tile5")
    case["cu"] = cu_to(case["cu"], "cpu")  # what the loader does when it moves a batch to the GPU
    with HostReads() as reads:
        run_ranks(cp, _rank_fn(case, reads, calls=1), timeout=60)
    assert reads.sites == [], reads.sites


def test_no_host_reads_in_the_triton_ring_after_the_first_layer():
    pytest.importorskip("triton", reason="triton is not installed")
    from backends import attention_triton  # noqa: F401  (the interpreter was set by conftest.py on CPU)
    if not torch.cuda.is_available() and not attention_triton.INTERPRETED:
        pytest.skip("attention_triton was imported before TRITON_INTERPRET=1 and there is no GPU")
    case = make_case([13, 5], 2, P=1, Hkv=1, G=2, D=16, dtype=torch.float32, seed=3, backend="triton")
    host_cu(case["cu"])
    with HostReads() as reads:
        run_ranks(2, _rank_fn(case, reads, calls=2), timeout=300)
    assert reads.sites == [], reads.sites


def test_no_host_reads_in_cp_shift_after_the_first_call():
    cu = cu_to(torch.tensor([0, 12, 20], dtype=torch.int32), "cpu")  # lengths multiples of 2 * cp = 4
    x = torch.randn(20, 3)

    def rank(ring):
        xs = zigzag_shard(x, cu, 2, ring.rank).requires_grad_()
        for i in range(2):
            with reads.active() if i else contextlib.nullcontext():
                for d in (1, 3, -2):
                    cp_shift(xs, cu, d, group=ring)[0].sum().backward()
        return True

    with HostReads() as reads:
        run_ranks(2, rank, timeout=60)
    assert reads.sites == [], reads.sites
