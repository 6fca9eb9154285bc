"""Processes agree on a batch's static shapes without a device collective.

In a multi-process run each process prepares only its own samples (`prepare`), but the
placed arrays are one global array whose shape (capacity, length cap, route capacity) every
process must use. `ProcessAgreement.max(values)` returns the elementwise maximum over the
processes through `jax.distributed`'s key-value store: host integers over the
coordinator's connection, so it may run on a background preparation thread (a device
collective there could interleave with the training step's collectives in a different
order on different processes, and hang). It also notices a dead peer: a process that has
not answered within `timeout_s` makes it raise, naming the process.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import jax

__all__ = ["ProcessAgreement"]

_instances = itertools.count()


class ProcessAgreement:
    """Elementwise max of small integer lists over all processes (identity for one)."""

    def __init__(self, timeout_s: float = 300.0):
        self.tag = f"hybridrec/agree/{next(_instances)}"  # same construction order everywhere
        self.timeout_ms = int(timeout_s * 1000)
        self._round = 0

    def max(self, values: Sequence[int]) -> list[int]:
        values = [int(v) for v in values]
        if jax.process_count() == 1:
            return values
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError(
                "several JAX processes but jax.distributed has no client; call jax.distributed.initialize"
            )
        me, n = jax.process_index(), jax.process_count()
        key = f"{self.tag}/{self._round}"
        client.key_value_set(f"{key}/{me}", json.dumps(values))
        out = values
        for p in range(n):
            if p == me:
                continue
            try:
                theirs = json.loads(client.blocking_key_value_get(f"{key}/{p}", self.timeout_ms))
            except Exception as e:  # the client raises its own error types
                raise RuntimeError(
                    f"process {p} did not report its batch shapes within {self.timeout_ms / 1000:.0f} s "
                    f"(round {self._round} of {self.tag}); it may have died or fallen behind: {e}"
                ) from e
            out = [max(a, b) for a, b in zip(out, theirs, strict=True)]
        if self._round >= 2:  # everyone has read round-2 by now (they are at this round)
            try:
                client.key_value_delete(f"{self.tag}/{self._round - 2}/{me}")
            except Exception:  # noqa: S110 - best effort cleanup of the store
                pass
        self._round += 1
        return out
