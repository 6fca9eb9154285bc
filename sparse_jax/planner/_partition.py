"""Greedy partitioner with local improvement: pick one option per item under the memory budget.

An *item* is a table, or a group of tables kept together; each of its options costs
every device some bytes and some ms per step (`mem`, `ms`: options x devices). The
objective is the per-device ms vector sorted from the largest down, compared
lexicographically: first the max device cost, then the next largest, and so on (so a
move that relieves a non-maximal device still counts as progress).

`greedy`: items in the given order (largest first), each takes the option with the
smallest key given the items before it: first a lower bound on the final max (the larger
of the max device load and the average load once the rest is placed at its cheapest),
then the total load, then the sorted vector; among equal keys the earlier option wins.
`preferred` (a boolean mask per item) restricts the choice to those options when one of
them fits. `improve`: re-place one item at a time given all the others, only on strict
improvement of the objective, until a pass changes nothing. `improve_pairs`: the same
with two items at once (every pair of their options), for the best proposal only.
Everything is deterministic: no sets, no hashing, stable sorts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_PASSES = 12


@dataclasses.dataclass(frozen=True)
class Item:
    names: tuple[str, ...]
    options: tuple  # per option: one ParameterSharding per name
    mem: np.ndarray  # options x devices, bytes
    ms: np.ndarray  # options x devices, ms per step


@dataclasses.dataclass(frozen=True)
class Failure:
    """The item (index) no option of which fit, and the free memory per device then."""

    item: int
    free: np.ndarray


def _sorted_desc(rows: np.ndarray) -> np.ndarray:
    return -np.sort(-rows, axis=-1)


def best_option(
    load_ms, load_mem, item: Item, budget: float, preferred=None, rest: float | None = None
) -> int | None:
    """Index of the option minimizing the sorted load vector, among those that fit.

    With `rest` (the least total ms the items still to place will add), the key is
    first max(max device load, (all load + rest) / devices), a lower bound on the final
    max, then the total load, then the sorted vector: early in a greedy pass, when that
    bound dominates, this picks the option that adds the least total work instead of
    the one that spreads thinnest.
    """
    fits = ((load_mem + item.mem) <= budget).all(axis=1)
    if preferred is not None and (fits & preferred).any():
        fits = fits & preferred
    idx = np.flatnonzero(fits)
    if idx.size == 0:
        return None
    new = load_ms + item.ms[idx]
    keys = _sorted_desc(new)
    columns = list(keys.T[::-1])
    if rest is not None:
        total = new.sum(axis=1)
        bound = np.maximum(keys[:, 0], (total + rest) / new.shape[1])
        columns += [total, bound]
    return int(idx[np.lexsort(columns)[0]])


def loads(items, assign) -> tuple[np.ndarray, np.ndarray]:
    n = items[0].ms.shape[1]
    ms, mem = np.zeros(n), np.zeros(n)
    for item, a in zip(items, assign, strict=True):
        ms += item.ms[a]
        mem += item.mem[a]
    return ms, mem


def objective(items, assign) -> tuple[float, ...]:
    return tuple(_sorted_desc(loads(items, assign)[0]).tolist())


def greedy(items, order, budget: float, preferred=None) -> list[int] | Failure:
    n = items[0].ms.shape[1]
    load_ms, load_mem = np.zeros(n), np.zeros(n)
    assign = [0] * len(items)
    least = [items[i].ms.sum(axis=1).min() for i in order]
    for k, i in enumerate(order):
        pref = None if preferred is None else preferred[i]
        a = best_option(load_ms, load_mem, items[i], budget, pref, rest=float(sum(least[k + 1 :])))
        if a is None:
            return Failure(i, budget - load_mem)
        assign[i] = a
        load_ms += items[i].ms[a]
        load_mem += items[i].mem[a]
    return assign


def improve(items, assign, order, budget: float) -> list[int]:
    assign = list(assign)
    for _ in range(MAX_PASSES):
        load_ms, load_mem = loads(items, assign)
        changed = False
        for i in order:
            item, a = items[i], assign[i]
            load_ms -= item.ms[a]
            load_mem -= item.mem[a]
            b = best_option(load_ms, load_mem, item, budget)
            if b is not None and b != a:
                new, old = _sorted_desc(load_ms + item.ms[b]), _sorted_desc(load_ms + item.ms[a])
                if tuple(new.tolist()) < tuple(old.tolist()):
                    assign[i], a, changed = b, b, True
            load_ms += item.ms[a]
            load_mem += item.mem[a]
        if not changed:
            break
    return assign


def improve_pairs(items, assign, order, budget: float) -> list[int]:
    """Like `improve`, but re-placing two items at once (every pair of their options), the
    first of them one that loads the busiest device. This escapes plateaus where one item
    must move to make room for another."""
    assign = improve(items, assign, order, budget)
    for _ in range(MAX_PASSES):
        changed = False
        load_ms, load_mem = loads(items, assign)
        for x, i in enumerate(order):
            if items[i].ms[assign[i], int(np.argmax(load_ms))] <= 0:
                continue
            for j in order[:x] + order[x + 1 :]:
                a, b = assign[i], assign[j]
                base_ms = load_ms - items[i].ms[a] - items[j].ms[b]
                base_mem = load_mem - items[i].mem[a] - items[j].mem[b]
                cj = len(items[j].options)
                fits = (
                    (base_mem + items[i].mem[:, None, :] + items[j].mem[None, :, :]) <= budget
                ).all(axis=2)
                new = (base_ms + items[i].ms[:, None, :] + items[j].ms[None, :, :]).reshape(
                    -1, len(load_ms)
                )
                idx = np.flatnonzero(fits.reshape(-1))
                keys = _sorted_desc(new[idx])
                k = int(idx[np.lexsort(keys.T[::-1])[0]])
                better = tuple(_sorted_desc(new[k]).tolist()) < tuple(
                    _sorted_desc(new[a * cj + b]).tolist()
                )
                if k != a * cj + b and better:
                    assign[i], assign[j], changed = k // cj, k % cj, True
                    load_ms = base_ms + items[i].ms[assign[i]] + items[j].ms[assign[j]]
                    load_mem = base_mem + items[i].mem[assign[i]] + items[j].mem[assign[j]]
                    if items[i].ms[assign[i], int(np.argmax(load_ms))] <= 0:
                        break
        assign = improve(items, assign, order, budget)
        if not changed:
            break
    return assign


def search(items, orders, preferences, budget: float, polish: int = 1) -> list[int] | Failure:
    """Best of greedy + improve over every (order, preference) proposal; the `polish`
    best are then improved by pair moves.

    Returns the assignment with the smallest objective (ties: the first proposal), or the
    first proposal's Failure when no proposal fits.
    """
    found, first_failure, seen = [], None, []
    for order in orders:
        for preferred in preferences:
            start = greedy(items, order, budget, preferred)
            if isinstance(start, Failure):
                first_failure = first_failure or start
                continue
            if start in seen:
                continue
            seen.append(start)
            assign = improve(items, start, order, budget)
            found.append((objective(items, assign), len(found), assign, order))
    if not found:
        return first_failure
    found.sort(key=lambda f: (f[0], f[1]))
    polished = []
    for _, rank, assign, order in found[:polish]:
        assign = improve_pairs(items, assign, order, budget)
        polished.append((objective(items, assign), rank, assign))
    return min(polished, key=lambda f: (f[0], f[1]))[2]
