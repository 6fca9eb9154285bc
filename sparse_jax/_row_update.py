"""Which kernel runs a buffer's fused update, chosen when the program is lowered.

`update_rows` takes one buffer's flat id stream (`rows, bag, scale`, `bag_grads`; see
`sparse_jax._lookup.id_stream`) and binds one `by_platform` op whose implementation is:

| kernel | CPU | CUDA | other (TPU) |
|---|---|---|---|
| "auto" (default) | C++ (`jax.ffi`) for fp32 sgd / adagrad / rowwise_adagrad when built, else XLA | Pallas sorted-run kernel (power-of-two dims, native rules), else XLA without scatter-add | XLA |
| "ffi" | C++ (an error when it cannot run) | as "auto" | as "auto" |
| "pallas" | Pallas in interpret mode (tests) | Pallas | Pallas in interpret mode |
| "xla", "reference" | XLA | XLA without scatter-add | XLA |

A rule takes a native kernel only if it declares it (`RowRule.native`), never by its name.
Under the non-finite guard (`sparse_jax._guard`) every implementation masks its writes
with the traced flag: nothing is written when it is false, with no branch in the program.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sparse_jax import _guard, _kernels
from sparse_jax._kernels import _pallas
from sparse_jax._kernels._platform import by_platform
from sparse_jax._lookup import check_kernel, use_ffi
from sparse_jax.optim._apply import apply_row_rule
from sparse_jax.optim._base import RowRule

__all__ = ["ffi_rule", "pallas_rule", "update_rows"]

_NARROW = (jnp.float32, jnp.float16, jnp.bfloat16)


def ffi_rule(rule: RowRule, table) -> bool:
    """The C++ kernels implement this rule on this buffer (fp32, a native rule they know)."""
    from sparse_jax import _kernels

    return rule.native in _kernels.RULES and table.dtype == jnp.float32


def pallas_rule(rule: RowRule, table, state) -> bool:
    """The Pallas sorted-run kernel implements this rule on this buffer."""
    num_rows, dim = table.shape
    return (
        rule.native is not None
        and _pallas.supports_dim(dim)
        and any(table.dtype == d for d in _NARROW)
        and _pallas.per_row_state(state, num_rows, dim)
    )


class _HostRuns(NamedTuple):
    """The host-sorted stream's fields the Pallas update reads (`_sorted_ids.SortedIds`)."""

    unique: jax.Array
    offsets: jax.Array
    bag: jax.Array
    scale: jax.Array
    chunks: jax.Array | None
    run_chunks: jax.Array | None


def update_rows(
    rule: RowRule,
    table,
    state,
    step,
    rows,
    bag,
    scale,
    bag_grads,
    *,
    kernel: str,
    sorted_ids=None,
):
    """One fused update of one buffer: `(new table, new state)` (see the module's table).
    `sorted_ids`: the batch's host-sorted stream of this buffer (`sparse_jax._sorted_ids`)
    or None; the Pallas update then reads its runs instead of sorting the ids."""
    check_kernel(kernel)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    num_rows = table.shape[0]
    extra = ()
    if sorted_ids is not None:  # the host's runs
        extra = (sorted_ids.unique, sorted_ids.offsets, sorted_ids.bag, sorted_ids.scale)
        if sorted_ids.chunks is not None:
            extra = (*extra, sorted_ids.chunks, sorted_ids.run_chunks)
    operands = (table, jnp.asarray(step, jnp.int32), rows, bag, scale, bag_grads, *extra, *leaves)

    def unpack(ops):
        """The operands, and the guard's flag (`by_platform` sets it again around each
        implementation when the program is lowered; None unguarded)."""
        t, s, r, b, sc, g = ops[:6]
        lv = ops[6 + len(extra) :]
        return t, jax.tree_util.tree_unflatten(treedef, lv), s, r, b, sc, g, _guard.current()

    def flat(out):
        return [out[0], *jax.tree_util.tree_leaves(out[1])]

    def xla(scatter_add: bool):
        def run(*ops):
            t, st, s, r, b, sc, g, ok = unpack(ops)
            return flat(
                apply_row_rule(rule, t, st, s, r, b, sc, g, scatter_add=scatter_add, good=ok)
            )

        return run

    def pallas(interpret: bool):
        def run(*ops):
            t, st, s, r, b, sc, g, ok = unpack(ops)
            if extra:  # sorted on the host: one program per run (per chunk first if long)
                unique, offsets, b, sc, *chunked = ops[6 : 6 + len(extra)]
                runs = _HostRuns(unique, offsets, b, sc, *(chunked or (None, None)))
                return flat(
                    _pallas.host_runs_update(rule, t, st, s, runs, g, ok, interpret=interpret)
                )
            # no host runs: found and chunked in the program
            return flat(
                _pallas.chunked_run_update(rule, t, st, s, r, b, sc, g, ok, interpret=interpret)
            )

        return run

    def ffi(*ops):
        t, st, _, r, b, sc, g, ok = unpack(ops)
        if ok is not None:
            r = jnp.where(ok, r, num_rows)  # the kernel skips rows outside the buffer
        leaf = st.get("momentum1") if isinstance(st, dict) else None
        new_t, new_leaf = _kernels.fused_update(
            rule.native,
            t,
            leaf,
            r,
            b,
            sc,
            g,
            lr=rule.hyperparams["lr"],
            eps=rule.hyperparams.get("eps", 0.0),
        )
        return flat((new_t, {"momentum1": new_leaf} if leaf is not None else st))

    if kernel == "pallas":
        if not pallas_rule(rule, table, state):
            raise ValueError(
                f"kernel='pallas' cannot run {rule.name!r} on a {table.dtype} [{num_rows}, "
                f"{table.shape[1]}] buffer (needs a native rule and a power-of-two dim); use 'auto'"
            )
        impls = dict(default=pallas(True), cuda=pallas(False))
    elif kernel in ("xla", "reference"):
        impls = dict(default=xla(True), cuda=xla(False))
    else:
        use_cpu = ffi_rule(rule, table) and (kernel == "auto" or use_ffi(kernel, table))
        impls = dict(
            default=xla(True),
            cpu=_kernels.when_built(ffi, xla(True)) if use_cpu else None,
            cuda=pallas(False) if pallas_rule(rule, table, state) else xla(False),
        )
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (table, *leaves)]
    out = by_platform(operands, avals, **impls)
    return out[0], jax.tree_util.tree_unflatten(treedef, out[1:])
