"""Workloads with FBGEMM's TBE benchmark knobs, and the one batch both sides consume.

Knobs (FBGEMM's `split_table_batched_embeddings_benchmark.py` names): T tables of E rows
and dim D, batch B, fixed bag size L, `alpha` (<= 1.0: uniform ids; > 1.0: Zipf(alpha),
generated as FBGEMM's `generate_indices_zipf`), per-id weights (`weighted`), table dtype.

Layout is FBGEMM's and TorchRec's: bag (t, b) is `offsets[t * B + b]`, features key-major.
Every table starts from the same values on both sides; for fp16 / bf16 the values are
rounded to that dtype first, so both sides start bit-identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["DTYPES", "Batch", "Workload", "default_set", "make_batch", "tiny_set"]

DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}  # table storage dtype -> bytes per element
OUT_BYTES = 4  # pooled outputs are fp32 on both sides


@dataclasses.dataclass(frozen=True)
class Workload:
    T: int = 8
    E: int = 100_000
    D: int = 64
    B: int = 2048
    L: int = 20
    alpha: float = 1.0  # <= 1.0 uniform (FBGEMM's convention), > 1.0 Zipf
    weighted: bool = False
    dtype: str = "fp32"
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        for k in ("T", "E", "D", "B", "L"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1")
        if self.D % 4:
            raise ValueError(f"D={self.D}: FBGEMM needs embedding dims that are multiples of 4")
        if self.alpha > 1.0 and self.E < self.L:
            raise ValueError("Zipf ids need E >= L (ids are distinct within a bag)")

    @property
    def name(self) -> str:
        dist = "uniform" if self.alpha <= 1.0 else f"zipf{self.alpha:g}"
        w = "-weighted" if self.weighted else ""
        return f"T{self.T}-E{self.E}-D{self.D}-B{self.B}-L{self.L}-{dist}-{self.dtype}{w}"

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def num_ids(self) -> int:
        return self.T * self.B * self.L

    def fwd_bytes(self) -> int:
        """FBGEMM's convention: rows read (B*T*L*D*itemsize) + pooled output written (B*T*D*4)."""
        return (
            self.B * self.T * self.L * self.D * self.itemsize + self.B * self.T * self.D * OUT_BYTES
        )

    def bwd_bytes(self) -> int:
        """FBGEMM's benchmark convention for the backward (+ fused optimizer): 2x forward bytes."""
        return 2 * self.fwd_bytes()

    def table_bytes(self) -> int:
        return self.T * self.E * self.D * self.itemsize

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.name}


def default_set() -> list[Workload]:
    """W1 uniform and W1 with Zipf(1.15) (FBGEMM's recommended training-like skew)."""
    return [Workload(), Workload(alpha=1.15)]


def tiny_set() -> list[Workload]:
    """Seconds-long smoke run with the same shapes of code paths (uniform and Zipf)."""
    tiny = dict(T=2, E=1000, D=16, B=64, L=4)
    return [Workload(**tiny), Workload(**tiny, alpha=1.15)]


@dataclasses.dataclass
class Batch:
    ids: np.ndarray  # int64 [T*B*L], key-major bags
    offsets: np.ndarray  # int64 [T*B + 1]
    lengths: np.ndarray  # int32 [T*B]
    per_sample_weights: np.ndarray | None  # float32 [T*B*L] or None
    tables: np.ndarray  # float32 [T, E, D], values exactly representable in the workload dtype
    pooled_grad: np.ndarray  # float32 [B, T*D]: d loss / d pooled output


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "fp32":
        return x
    import ml_dtypes  # shipped with jax

    np_dtype = np.float16 if dtype == "fp16" else ml_dtypes.bfloat16
    return x.astype(np_dtype).astype(np.float32)


def _zipf_ids(
    rng: np.random.Generator, bags: int, L: int, E: int, alpha: float, oversample: int = 3
) -> np.ndarray:
    """FBGEMM's `generate_indices_zipf` (CPU path): draw `oversample * L` Zipf samples per bag,
    map `(z - 1) % E`, keep the L smallest distinct ones (`bottom_k_per_row`), then relabel
    ids with a random permutation of [0, E) so hot rows are not contiguous."""
    z = (rng.zipf(alpha, size=(bags, oversample * L)) - 1) % E
    z.sort(axis=1)
    dup = np.zeros_like(z, dtype=bool)
    dup[:, 1:] = z[:, 1:] == z[:, :-1]
    z[dup] = np.iinfo(z.dtype).max
    z.sort(axis=1)
    if np.any(z[:, L - 1] == np.iinfo(z.dtype).max):
        raise ValueError(
            f"Zipf(alpha={alpha}) is too skewed to draw {L} distinct ids per bag from E={E}"
        )
    z = z[:, :L]
    perm = rng.choice(E, size=int(z.max()) + 1, replace=False)
    return perm[z]


def make_batch(w: Workload) -> Batch:
    rng = np.random.default_rng(w.seed)
    bags = w.T * w.B
    if w.alpha <= 1.0:
        ids = rng.integers(0, w.E, size=(bags, w.L), dtype=np.int64)
    else:
        ids = _zipf_ids(rng, bags, w.L, w.E, w.alpha).astype(np.int64)
    lengths = np.full(bags, w.L, np.int32)
    offsets = np.arange(0, bags * w.L + 1, w.L, dtype=np.int64)
    psw = rng.uniform(0.5, 1.5, size=bags * w.L).astype(np.float32) if w.weighted else None
    bound = float(np.sqrt(1.0 / w.E))  # TorchRec's default init range
    tables = rng.uniform(-bound, bound, size=(w.T, w.E, w.D)).astype(np.float32)
    tables = _round_to(tables, w.dtype)
    grad = rng.standard_normal((w.B, w.T * w.D)).astype(np.float32)
    return Batch(ids.reshape(-1), offsets, lengths, psw, tables, grad)
