"""The correctness gate: nothing is timed unless both sides compute the same numbers.

`close(a, b, rtol)` is `|a - b| <= rtol * (|b| + max|b|)`: relative to each value, with an
absolute floor of `rtol` times the array's largest magnitude (pooled sums of +-values cross
zero, where a pure relative test would flag fp32 summation-order noise).

Tolerances: rtol 1e-4 for fp32 tables and for pooled outputs (always fp32). Updated fp16 /
bf16 weights are rounded to the table dtype on both sides after an fp32 step, so the two
can differ by one unit in the last place of that dtype: their rtol is that dtype's epsilon.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GateError", "close", "update_rtol", "RTOL"]

RTOL = 1e-4
_EPS = {"fp32": 0.0, "fp16": 2.0**-10, "bf16": 2.0**-7}


class GateError(RuntimeError):
    """The two sides disagree: timings would compare different computations."""


def update_rtol(dtype: str) -> float:
    return max(RTOL, _EPS[dtype])


def close(what: str, ours, theirs, rtol: float = RTOL) -> dict:
    """Compare and describe; `ok` False (never raises) so the caller can report every check."""
    a = np.asarray(
        ours, np.float32
    )  # fp32 arithmetic: exact enough for rtol >= 1e-4, half the memory
    b = np.asarray(theirs, np.float32)
    if a.shape != b.shape:
        return {"what": what, "ok": False, "error": f"shape {a.shape} vs {b.shape}"}
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return {"what": what, "ok": False, "error": "non-finite values"}
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    err = np.abs(a - b)
    bound = rtol * (np.abs(b) + scale)
    bad = int(np.count_nonzero(err > bound))
    return {
        "what": what,
        "ok": bad == 0,
        "rtol": rtol,
        "max_abs_err": float(err.max()) if err.size else 0.0,
        "max_abs_ref": scale,
        "mismatches": bad,
        "size": int(b.size),
    }
