"""harness/cost_comm.py counts the communication one rank issues in one update from the mesh alone. Here a real
DistCotrainer.step + refit runs on 4 gloo processes under three layouts, every exchange and collective it issues is
counted on every rank (ring hops by their labels, pipeline batches by their group, collectives by name), and the
counts must equal the model's: the context ring's hops per stage pass exactly, the pipeline's batches on the last
stage exactly (one per micro-batch and one more), the collectives after the pipeline exactly on the rank that
issues the most, the bytes of the ring and of TapChannel within the padding the model leaves out.
One spawn, three layouts: ~15 s on 2 cores; the by-hand check < 1 s."""
import pytest
import torch
import torch.distributed as dist
from dist_util import run_distributed

from dist_step import DistCotrainer
from draft import Eagle3Draft
from harness.cost_comm import comm_counts, comm_seconds
from harness.cost_inputs import Arch, Device
from harness.cost_model import Workload, update
from model import ModelConfig, Transformer
from parallel.grid import Grid
from rl_loop import DraftTrainer, GRPOConfig, RolloutBatch

LAYOUTS = [(1, 2, 2), (1, 4, 1), (2, 1, 2)]  # (dp, pp, cp)
MICRO, ROWS, LAYERS = 2, 16, 4
RING = ("ring attention K/V hop", "ring attention backward K/V hop", "ring attention dK/dV hop")


def _models():
    torch.manual_seed(0)
    policy = Transformer(ModelConfig.preset("tiny", num_hidden_layers=LAYERS, tie_word_embeddings=True))
    drafts = []
    for seed in (1, 2):  # the co-trained draft and a cold arm, as the default run has
        torch.manual_seed(seed)
        d = Eagle3Draft.from_target(policy)
        drafts.append(DraftTrainer(d, torch.optim.AdamW(d.parameters(), lr=1e-3), num_passes=3))
    return policy, drafts


def _batch(policy):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(policy.cfg.vocab_size, (4,), generator=g) for _ in range(ROWS)]
    resps = [torch.randint(policy.cfg.vocab_size, (8,), generator=g) for _ in range(ROWS)]
    b = RolloutBatch.from_rollouts(prompts, resps, [torch.zeros(8)] * ROWS, torch.randn(ROWS, generator=g),
                                   torch.ones(ROWS, dtype=torch.bool))
    b.old_logp = torch.zeros(b.tokens.shape)
    return b


def _counting(counts, grid):
    """Wrap the communication calls; return the originals to restore."""
    import parallel.ring as ring_mod
    saved = {}

    def wrap(owner, name, fn):
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, fn)

    orig_exchange = ring_mod.DistRing.exchange

    def exchange(self, sends, recvs, what="ring exchange"):
        counts[what] = counts.get(what, 0) + 1
        counts[what + " bytes"] = counts.get(what + " bytes", 0) + sum(t.numel() * t.element_size() for _, t in sends)
        return orig_exchange(self, sends, recvs, what)
    wrap(ring_mod.DistRing, "exchange", exchange)
    orig_batch = dist.batch_isend_irecv

    def batch(ops):
        if ops and ops[0].group is grid.pp_group:
            counts["pipeline"] = counts.get("pipeline", 0) + 1
        return orig_batch(ops)
    wrap(dist, "batch_isend_irecv", batch)
    for name, n in (("all_reduce", 1), ("broadcast", 1), ("all_gather", 1), ("all_gather_object", 2)):
        orig = getattr(dist, name)

        def coll(*a, _orig=orig, _n=n, **kw):
            counts["post"] = counts.get("post", 0) + _n
            return _orig(*a, **kw)
        wrap(dist, name, coll)
    return saved


def _worker(rank, world):
    out = []
    for dp, pp, cp in LAYOUTS:
        grid = Grid.build(pp=pp, cp=cp, dp=dp)
        policy, drafts = _models()
        ct = DistCotrainer(policy, drafts, grid, lambda p: torch.optim.AdamW(p, lr=1e-3), grad_clip=1.0)
        batch = _batch(policy)
        grpo = GRPOConfig(loss_norm="global-token", max_len=16, beta=0.0)
        res = {}
        for train in (False, True):  # without the drafts (the policy's own traffic), then with them (TapChannel)
            counts = {}
            saved = _counting(counts, grid)
            try:
                st = ct.step(batch, grpo, MICRO, train_drafts=train)
                ct.refit(policy)
            finally:
                for (owner, name), fn in saved.items():
                    setattr(owner, name, fn)
            res[train] = dict(counts, tap_bytes=st["tap_bytes"])
        out.append(dict(layout=(dp, pp, cp), last=grid.pp_rank == pp - 1, own=res[False], taps=res[True]))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def counted():
    return run_distributed(_worker, 4, timeout=180)


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=[f"dp{d}-pp{p}-cp{c}" for d, p, c in LAYOUTS])
def test_the_model_counts_what_a_real_update_issues(counted, i):
    dp, pp, cp = LAYOUTS[i]
    policy, _ = _models()
    c = policy.cfg
    a = Arch(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
             c.intermediate_size, c.vocab_size, tied=c.tie_word_embeddings)
    w = Workload(rows=ROWS, prompt_len=4, resp_len=8, updates=1, micro_batches=MICRO, pp=pp, cp=cp, dp=dp, drafts=2)
    Mr = MICRO / dp  # micro-batches per rank: dist_step deals the step's MICRO out over the DP replicas
    T = ROWS * 12 / (Mr * dp * cp)  # tokens per micro-batch and rank, before CP's padding
    n = comm_counts(a, w, T, act_bytes=4)
    ring_ops = n["stage"][0] - (pp > 1)  # the pipeline's batch per stage pass
    post = n["post"][0] - (pp > 1)  # the pipeline's last batch: counted with the pipeline's batches here
    post += n["step"][0] - 1  # and the refit that follows the step (its world_cpu all-reduce is train.py's)
    ranks = [r[i] for r in counted]
    for r in ranks:
        assert r["layout"] == (dp, pp, cp)
        own = r["own"]  # the policy's own traffic: no draft hook, no TapChannel
        assert sum(own.get(what, 0) for what in RING) == ring_ops * Mr, own  # every rank: each of its passes
        if cp > 1:
            got = sum(own[what + " bytes"] for what in RING)
            assert 1.0 <= got / ((n["stage"][1] - (pp > 1) * T * a.hidden * 4) * Mr) <= 1.35, own  # CP padding
        if pp > 1:
            assert own["pipeline"] == (Mr + 1 if r["last"] else own["pipeline"]) <= 2 * Mr + 1, own
        assert own["post"] <= post, own
    assert max(r["own"]["post"] for r in ranks) == post
    sent = sum(r["taps"]["tap_bytes"] for r in ranks)  # every source's taps reach a last-stage rank
    last = [r for r in ranks if r["last"]]
    want = n["taps"][1] * len(last)  # per last-stage rank: remote taps x micro-batches x T H b
    assert (sent == 0) if pp == 1 else 1.0 <= sent / want <= 1.35, (sent, want)


def test_counts_and_seconds_by_hand():
    """A 4-layer policy (H 8, 2 / 1 heads of 4, I 16, V 10, tied) on pp 2 x cp 2, 8 rows of 2 + 6 tokens, 2 updates,
    1 micro-batch, 2 drafts: T = 8 x 8 / (2 x 2) = 16 tokens per rank. Per stage pass: 2 layers x (1 + 1 + 2) ring
    hops + 1 pipeline batch = 9 ops; bytes 2 x ((1 + 1) x 2 T kv 4 + 2 x 2 T kv 4) + T H 4 = 4096 + 512. After
    the pipeline: the tied embedding (2 V H 4 = 640 B), the CP bucket (2 x 1192 weights x 4), the loss over CP and
    PP, the norm over PP, the boundaries over CP, the pipeline's last batch, 3 statistics ops = 10 ops, 10176 B. Per
    RL step: the CPU seconds' all-reduce, the refit's 2 stage + 2 draft broadcasts (P + 2 P_d = 2384 + 2 x 976
    weights x 4 B) and its fingerprints (3 models x 8 B) = 6 ops, 17368 B. Taps: the embedding and layers 0, 1 live
    on stage 0: 3. The second update's pi_old forward, per stage pass: 2 layers x 1 K/V hop + 1 pipeline send = 3
    ops, 2 x 2 T kv 4 + T H 4 = 1536 B. <1 s."""
    a = Arch(4, 8, 2, 1, 4, 16, 10, tied=True)
    w = Workload(rows=8, prompt_len=2, resp_len=6, updates=2, micro_batches=1, pp=2, cp=2, drafts=2)
    n = comm_counts(a, w, T=16, act_bytes=4)
    assert n == {"stage": (9, 4608), "post": (10, 10176), "taps": (3, 3 * 16 * 8 * 4), "step": (6, 17368),
                 "forward": (3, 1536)}
    assert comm_counts(a, Workload(rows=8, prompt_len=2, resp_len=6), T=64)["post"] == (0, 0)  # one process: none
    dev = Device(cores=1, overheads={"o_comm": 1e-3}, BW_comm=1e6)  # 1 core: the compute runs x C(A) = 2 or 4
    bare = Device(cores=1)
    assert comm_seconds(dev, n["stage"]) == pytest.approx(9e-3 + 4608e-6)
    # u ((M + pp - 1) stage + post + share taps) + (u - 1) (M + pp - 1) forward + step, no contention factor (probed
    # at the run's process count)
    want = 2 * (2 * (9e-3 + 4608e-6) + (10e-3 + 10176e-6) + (3e-3 + 1536e-6)) + 2 * (3e-3 + 1536e-6) + (
        6e-3 + 17368e-6)
    assert update(a, dev, w) - update(a, bare, w) == pytest.approx(want)
