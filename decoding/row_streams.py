"""Per-row random streams: every rollout row draws from its own counter-based stream, so a row's tokens depend only on
its key -- (seed, step, prompt, sample), hashed -- and not on the rank that generates it, the rows that share its
batch, or the compaction of finished rows.

A stream is SplitMix64 [Steele, Lea & Flood 2014] seeded with the row's key: its n-th 64-bit output is

    x_n = mix(key + (n + 1) * GOLDEN)        mix(z): z ^= z >>> 30; z *= M1; z ^= z >>> 27; z *= M2; z ^= z >>> 31

(arithmetic mod 2^64, >>> a logical shift), and a uniform in [0, 1) in a dtype with m mantissa bits (fp32: 24,
fp64: 53) is (x_n >>> (64 - m)) * 2^-m, exact in that dtype. Each row keeps a counter of the outputs it has used; a
draw of n values per row reads outputs counter .. counter + n - 1 and advances it by n. Every step of the engine draws
the same number of values for every row (propose: k, verify: k + 1, ...), so a row's draws are a function of its own
history alone. Row keys are themselves mixes of the key parts (`row_keys`); two rows' streams overlap only if their
keys lie within a few thousand GOLDEN steps of each other: probability ~ rows^2 * draws / 2^64.

    streams = RowStreams(row_keys(seed, step, prompt_ids, sample_ids))    # (B,) rows
    u = streams.rand(k)                 # (B, k) uniforms, fp32 (the dtype argument picks another)
    x = streams.multinomial(p)          # (B,) one token per row ~ p (B, V): inverse CDF in fp64, one uniform per row
    streams.keep_rows(keep)             # compaction: the rows still generating (counters travel with them)

`uniform` / `multinomial` take either RowStreams or a torch.Generator (None: the global one), so callers that pass a
`generator=` keep torch's own stream exactly. The integer ops run on the rows' device (CPU or CUDA; torch's int64
multiply wraps mod 2^64 on both); `naive_stream` is the same hash in Python integers, the reference the tests hold it
to.

Letters: B rows, V vocab, n draws per row.
"""
from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
GOLDEN, M1, M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MANTISSA = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}  # significand bits


def _signed(c: int) -> int:  # an unsigned 64-bit constant as the int64 with the same bits
    return c - (1 << 64) if c >= 1 << 63 else c


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:  # logical right shift of int64 bits (>> is arithmetic in torch)
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (the bits of uint64 arithmetic mod 2^64)."""
    z = (z ^ _srl(z, 30)) * _signed(M1)
    z = (z ^ _srl(z, 27)) * _signed(M2)
    return z ^ _srl(z, 31)


def row_keys(*parts, device=None) -> torch.Tensor:
    """(B,) int64 keys from the parts (ints or (B,) int tensors, broadcast): key = mix(... mix(mix(p_1) + p_2) ...),
    each part added after the previous ones were mixed, so (1, 2) and (2, 1) differ."""
    key = None
    for p in parts:
        p = torch.as_tensor(p, dtype=torch.long, device=device)
        key = mix(p if key is None else key * _signed(GOLDEN) + p)
    return key.reshape(-1)


def naive_stream(key: int, n: int, start: int = 0) -> list:
    """Outputs start .. start + n - 1 of the stream of `key`, as unsigned Python ints: the reference."""
    def mix64(z):
        z = ((z ^ (z >> 30)) * M1) & _MASK
        z = ((z ^ (z >> 27)) * M2) & _MASK
        return z ^ (z >> 31)
    return [mix64((key + (i + 1) * GOLDEN) & _MASK) for i in range(start, start + n)]


def naive_row_key(*parts: int) -> int:
    """row_keys for one row, in Python integers (unsigned): the reference."""
    key = None
    for p in parts:
        z = p & _MASK if key is None else (key * GOLDEN + p) & _MASK
        z = ((z ^ (z >> 30)) * M1) & _MASK
        z = ((z ^ (z >> 27)) * M2) & _MASK
        key = z ^ (z >> 31)
    return key


class RowStreams:
    """One SplitMix64 stream per batch row: keys (B,) int64, counters (B,) int64 (outputs used so far)."""

    def __init__(self, keys: torch.Tensor):
        if keys.dtype != torch.long or keys.dim() != 1:
            raise ValueError(f"keys: expected a 1-D int64 tensor, got {keys.dtype} of shape {tuple(keys.shape)}")
        self.keys, self.count = keys, torch.zeros_like(keys)

    def __len__(self):
        return self.keys.numel()

    def bits(self, n: int) -> torch.Tensor:
        """(B, n) int64: the next n outputs of every row's stream; the counters advance by n."""
        i = self.count[:, None] + torch.arange(1, n + 1, device=self.keys.device)  # (B, n) output index + 1
        self.count = self.count + n
        return mix(self.keys[:, None] + i * _signed(GOLDEN))

    def rand(self, *shape: int, dtype=torch.float32) -> torch.Tensor:
        """(B, *shape) uniforms in [0, 1), exact in `dtype` (its mantissa's worth of each output's top bits)."""
        m = MANTISSA[dtype]
        n = 1
        for s in shape:
            n *= s
        u = _srl(self.bits(n), 64 - m).to(dtype) * 2.0 ** -m  # an integer < 2^m times a power of 2: exact
        return u.view(len(self), *shape)

    def multinomial(self, p: torch.Tensor) -> torch.Tensor:
        """(B, V) probabilities (rows sum to ~1, unnormalised is fine) -> (B,) one index per row, by the inverse CDF
        in fp64 with one uniform per row: the first v with cdf[v] > u * cdf[V-1]. A zero-probability index adds
        nothing to the cdf, so it is never drawn."""
        cdf = p.double().cumsum(-1)  # (B, V): sequential per row, whatever the batch
        total = cdf[:, -1:]
        x = torch.minimum(self.rand(1, dtype=torch.float64) * total, total.nextafter(torch.zeros_like(total)))
        return torch.searchsorted(cdf, x, right=True)[:, 0]

    def keep_rows(self, rows: torch.Tensor):
        """Compaction: keep these batch rows (their keys and counters), in this order."""
        self.keys, self.count = self.keys[rows], self.count[rows]


def uniform(shape, generator, device, dtype=torch.float32) -> torch.Tensor:
    """(B, ...) uniforms in [0, 1): from the rows' streams (RowStreams) or torch.rand with a torch.Generator / None."""
    if isinstance(generator, RowStreams):
        if shape[0] != len(generator):
            raise ValueError(f"row streams: {len(generator)} rows, asked for a draw of shape {tuple(shape)}")
        return generator.rand(*shape[1:], dtype=dtype)
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def multinomial(p: torch.Tensor, generator) -> torch.Tensor:
    """(B, V) -> (B,) one index per row ~ p: RowStreams.multinomial, or torch.multinomial with a torch.Generator."""
    if isinstance(generator, RowStreams):
        if p.shape[0] != len(generator):
            raise ValueError(f"row streams: {len(generator)} rows, asked to sample {p.shape[0]}")
        return generator.multinomial(p)
    return torch.multinomial(p, 1, generator=generator)[:, 0]
