"""The managed modules' compiled programs, shared by every module of one static configuration.

A remap program is built from a `spec`: a frozen, hashable value of everything static the
program reads (the tables' `MCHManagedCollisionModule`s, where their rows are written, the
configs of the rows it resets, the mesh and the buffers' layout), never from a module
instance. Two modules of equal specs get the same jitted program, so a second model of the
same configuration compiles nothing, and no program holds a module (nor a module a program
that another holds through it).

Why (issue 34): each module used to jit closures over `self`, so each model compiled its own
remap (~10 s of XLA:CPU per managed table on MovieLens) and its programs lived as long as
the module; XLA:CPU keeps each executable's code in its own memory mappings (~2,700 for the
three-table MovieLens remap), so every model kept alive (e.g. by a cache keyed by module)
added thousands of mappings, and ~11 of them reached the kernel's mapping limit
(`LLVM ERROR: Unable to allocate section memory`).

Lifetime: a program lives while a module holds it (modules hold theirs), and the `keep` most
recently used specs are held here besides, so building, dropping and rebuilding a model
reuses its programs. Beyond those, nothing is kept: once no module holds a program and it
has left the recent ones, its jitted function is collected, and JAX's own caches, keyed
weakly by that function, free the executables and their mappings (measured: dropping the
last reference brings the mappings back to their level before it compiled).
`jax.clear_caches()` also frees them (JAX's caches of every function); `clear()` here drops
the recent ones.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Hashable

import jax

__all__ = ["Program", "ProgramCache", "committed"]


class Program:
    """Named jitted functions built for one spec (e.g. `profile` and `scatter`), callable as
    attributes; `compile_count()` is how many executables they hold."""

    def __init__(self, **jitted):
        self._jitted = dict(jitted)
        for name, fn in jitted.items():
            setattr(self, name, fn)

    def compile_count(self) -> int:
        return sum(fn._cache_size() for fn in self._jitted.values())


class ProgramCache:
    """spec -> `Program`: built once by `build(spec)` (a module-level function of the spec
    alone), shared while any holder keeps it, and the `keep` most recently used kept here."""

    def __init__(self, build: Callable[[Hashable], Program], keep: int = 4):
        self._build, self.keep = build, keep
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # a pipeline prepares on another thread

    def get(self, spec: Hashable) -> Program:
        with self._lock:
            program = self._live.get(spec)
            if program is None:
                program = self._build(spec)
                self._live[spec] = program
            self._recent[spec] = program
            self._recent.move_to_end(spec)
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)
            return program

    def __len__(self) -> int:
        """Programs alive (held by a module or among the recent ones)."""
        return len(self._live)

    def clear(self) -> None:
        """Forget the recent programs (those modules still hold stay alive)."""
        with self._lock:
            self._recent.clear()


def committed(tree):
    """Every array of `tree` committed to where it is (jit keys its cache on commitment: an
    uncommitted first call and committed later ones would compile the same program twice)."""
    return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, x.sharding), tree)
