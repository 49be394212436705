"""The prefix cache of the slot layout: a store of pages beside the dense slot caches.

With ``kv_layout="pages"`` the prefix cache is the page pool itself (`cache.pages.PagePool` with
``prefix_caching``: a hit attaches the published pages, shared by reference). The slot layout (a CPU, a mesh)
keeps one dense run of positions per slot, read in place, so pages cannot be shared between slots there; instead,
full pages of a request's committed tokens are *copied* into a store of pages (`save_pages`) under the same chained
keys (`cache.pages.page_keys`), and a later request whose prompt starts with stored pages gets them copied into its
slot (`load_pages`) instead of prefilling them: a copy at memory speed in place of the forward pass. The store
holds the target's K/V and the drafter's context of the same positions, so a restored prefix drafts as if it had
been prefilled. `PrefixStore` is the store's host index (keys, least-recently-used eviction); the device arrays
are a `PrefixPages`.

Axis legend: P store pages, ps page size, L layers, K KV heads, E head width, S slots, C slot capacity,
N pages per slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dspark_jax.cache.pages import cached_run, page_keys

__all__ = ["PrefixStore", "PrefixPages", "init_prefix_pages", "save_pages", "load_pages", "as_pairs"]


class PrefixStore:
    """The host index of a store of ``num_pages`` pages of ``page_size`` tokens: which chained page key each
    store page holds, least recently used first out.

    >>> store = PrefixStore(num_pages=2, page_size=2)
    >>> store.add([5, 6, 7, 8, 9]), store.lookup([5, 6, 7, 8, 1])  # two full pages stored, then found
    ([(0, 0), (1, 1)], [0, 1])
    >>> store.lookup([5, 6, 7, 8]), store.add([1, 2, 3]), store.evictions  # the last token is left to compute
    ([0], [(0, 1)], 1)
    """

    def __init__(self, *, num_pages: int, page_size: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size)):
            if int(v) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._page_of: OrderedDict[bytes, int] = OrderedDict()  # key -> store page, least recently used first
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack, the lowest ids on top
        self.evictions = 0

    @property
    def stored_pages(self) -> int:
        """Store pages holding a key."""
        return len(self._page_of)

    def clear(self) -> None:
        """Forget every stored page (the device arrays are left as they are: nothing reads them)."""
        self._page_of.clear()
        self._free = list(range(self.num_pages - 1, -1, -1))

    def lookup(self, tokens: Sequence[int], namespace: bytes = b"") -> list[int]:
        """Store pages of the longest run of ``tokens``' leading full pages that is stored, leaving at least the
        last token to compute (its logits give the next token); they become the most recently used."""
        def find(key):
            page = self._page_of.get(key)
            if page is not None:
                self._page_of.move_to_end(key)
            return page

        return cached_run(tokens, self.page_size, namespace, find)

    def add(self, tokens: Sequence[int], namespace: bytes = b"", *, skip: int = 0) -> list[tuple[int, int]]:
        """Store pages for the full pages of ``tokens`` (a slot's committed tokens, from position 0) not stored
        yet, from page ``skip`` on (pages the slot loaded from the store are there already). Returns (page index
        in the slot, store page) pairs for `save_pages` to copy, evicting the least recently used keys as needed
        (never one of this call's)."""
        keys = page_keys(tokens, self.page_size, namespace)
        out: list[tuple[int, int]] = []
        for j in range(skip, len(keys)):
            key = keys[j]
            if key in self._page_of:
                self._page_of.move_to_end(key)
                continue
            if self._free:
                page = self._free.pop()
            else:
                old = next(iter(self._page_of))
                if old in keys[:j]:  # every stored key is this request's: the store is full
                    break
                page = self._page_of.pop(old)
                self.evictions += 1
            self._page_of[key] = page
            out.append((j, page))
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefixPages:
    """The store's device arrays, in the slot caches' layouts (`models.llama.KVCache`,
    `models.drafter.DrafterCache`) cut into pages."""

    k: tuple[jax.Array, ...]  # L arrays [P, K, E, ps]
    v: tuple[jax.Array, ...]  # L arrays [P, K, ps, E]
    dk: jax.Array | None  # [Ld, P, ps, Kd, Ed] the drafter's context, or None without a drafter
    dv: jax.Array | None


def init_prefix_pages(cache, dcache, num_pages: int, page_size: int) -> PrefixPages:
    """An empty store of ``num_pages`` pages for ``cache`` (a slot `KVCache`) and ``dcache`` (a
    `DrafterCache` or None), in their dtypes."""
    k = tuple(jnp.zeros((num_pages, *x.shape[1:3], page_size), x.dtype) for x in cache.k)
    v = tuple(jnp.zeros((num_pages, x.shape[1], page_size, x.shape[3]), x.dtype) for x in cache.v)
    if dcache is None:
        return PrefixPages(k, v, None, None)
    L, _, _, K, E = dcache.k.shape
    shape = (L, num_pages, page_size, K, E)
    return PrefixPages(k, v, jnp.zeros(shape, dcache.k.dtype), jnp.zeros(shape, dcache.v.dtype))


@functools.partial(jax.jit, donate_argnums=0)
def save_pages(store: PrefixPages, cache, dcache, slot, slot_pages, store_pages, n) -> PrefixPages:
    """Copy pages ``slot_pages[:n]`` of ``slot``'s caches into store pages ``store_pages[:n]``.

    Args:
      store: the `PrefixPages` (donated).
      cache, dcache: the slot caches (`KVCache`, `DrafterCache` or None), read only.
      slot: int32 []; slot_pages, store_pages: int32 [N]; n: int32 [] pairs to copy (the rest is padding).
    Returns:
      the store with the pages written.
    """
    ps = store.k[0].shape[-1]

    def body(i, st: PrefixPages) -> PrefixPages:
        j, p = slot_pages[i] * ps, store_pages[i]
        k = tuple(lax.dynamic_update_slice(s, lax.dynamic_slice(c, (slot, 0, 0, j), (1, *c.shape[1:3], ps)), (p, 0, 0, 0))
                  for s, c in zip(st.k, cache.k, strict=True))
        v = tuple(lax.dynamic_update_slice(s, lax.dynamic_slice(c, (slot, 0, j, 0), (1, c.shape[1], ps, c.shape[3])),
                                           (p, 0, 0, 0))
                  for s, c in zip(st.v, cache.v, strict=True))
        if st.dk is None:
            return PrefixPages(k, v, None, None)

        def ctx(s, c):  # [L, S, C, K, E] -> [L, P, ps, K, E]
            L, _, _, K, E = c.shape
            return lax.dynamic_update_slice(s, lax.dynamic_slice(c, (0, slot, j, 0, 0), (L, 1, ps, K, E)),
                                            (0, p, 0, 0, 0))

        return PrefixPages(k, v, ctx(st.dk, dcache.k), ctx(st.dv, dcache.v))

    return lax.fori_loop(0, n, body, store)


@functools.partial(jax.jit, donate_argnums=(1, 2))
def load_pages(store: PrefixPages, cache, dcache, slot, slot_pages, store_pages, n):
    """Copy store pages ``store_pages[:n]`` into pages ``slot_pages[:n]`` of ``slot``'s caches.

    Args:
      store: the `PrefixPages`, read only.
      cache, dcache: the slot caches (donated; ``dcache`` None without a drafter).
      slot: int32 []; slot_pages, store_pages: int32 [N]; n: int32 [] pairs to copy.
    Returns:
      (cache, dcache) with the pages written; the cache's ``lengths`` are left to the prefill that follows.
    """
    ps = store.k[0].shape[-1]

    def body(i, carry):
        k, v, dk, dv = carry
        j, p = slot_pages[i] * ps, store_pages[i]
        k = tuple(lax.dynamic_update_slice(c, lax.dynamic_slice(s, (p, 0, 0, 0), (1, *s.shape[1:])), (slot, 0, 0, j))
                  for c, s in zip(k, store.k, strict=True))
        v = tuple(lax.dynamic_update_slice(c, lax.dynamic_slice(s, (p, 0, 0, 0), (1, *s.shape[1:])), (slot, 0, j, 0))
                  for c, s in zip(v, store.v, strict=True))
        if dk is not None:
            def ctx(c, s):  # [L, P, ps, K, E] -> [L, S, C, K, E]
                L, _, _, K, E = s.shape
                return lax.dynamic_update_slice(c, lax.dynamic_slice(s, (0, p, 0, 0, 0), (L, 1, ps, K, E)),
                                                (0, slot, j, 0, 0))

            dk, dv = ctx(dk, store.dk), ctx(dv, store.dv)
        return k, v, dk, dv

    dk, dv = (None, None) if dcache is None else (dcache.k, dcache.v)
    k, v, dk, dv = lax.fori_loop(0, n, body, (cache.k, cache.v, dk, dv))
    return cache.replace(k=k, v=v), (None if dcache is None else dcache.replace(k=dk, v=dv))


def as_pairs(pairs: Sequence[tuple[int, int]], width: int) -> tuple[np.ndarray, np.ndarray, np.int32]:
    """(slot pages [width], store pages [width], count) of ``pairs``, padded for `save_pages` / `load_pages`."""
    a, b = np.zeros(width, np.int32), np.zeros(width, np.int32)
    for i, (j, p) in enumerate(pairs):
        a[i], b[i] = j, p
    return a, b, np.int32(len(pairs))
