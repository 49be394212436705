"""The page pool's host side: which pages each request slot holds, allocated as its tokens are written.

A slot's block table row lists its pages in position order (page j holds positions ``j * page_size`` ..
``(j + 1) * page_size - 1``); the device programs read the table, the host writes it. Pages are taken from
a free list when a slot's tokens reach them (`PagePool.ensure`) and returned when its request ends
(`PagePool.release`). A request is admitted only when the pool can back its whole budget (prompt, answer
and one verification block beyond): the pages are *reserved* at admission (`PagePool.reserve`) and
allocated only as tokens arrive, so a running request never waits for a page and nothing needs preempting,
while pages a request never reaches stay free for the prefix cache and for requests that stop early to give
back.

With ``prefix_caching`` (the prefix cache's host side), a page whose positions a request has filled with tokens
is *published* under a key chained from every token up to its end (`page_keys`: equal pages under different
prefixes never share a key), and a later request whose prompt starts with the same full pages *attaches* them
instead of prefilling them: they are shared, read-only (a request writes only past its committed length, and
published pages lie wholly below it), counted by references. A published page nobody references stays cached,
least recently used first out, until the pool needs it: allocation takes a never-used or evicted page first,
then evicts the oldest cached one. Pages hold the drafter's context beside the target's K/V (same page ids),
so an attached prefix drafts as if it had been prefilled; a page written without the drafter's context is
published under another namespace.

``contiguous`` pools give slot ``s`` the fixed pages ``s * pages_per_slot + j``: the block table is the
identity and the pool, reshaped, is one dense run per slot, read in place by the CPU's XLA path (a gather of
pages costs XLA:CPU several times the attention's own read; docs/design.md). Allocation is then only counted.

Axis legend: S slots, N pages per slot (``pages_per_slot``), P pages in the pool, ps page size.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

__all__ = ["PagePool", "pages_for", "page_keys", "cached_run"]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that back ``tokens`` positions.

    >>> pages_for(17, 16), pages_for(0, 16)
    (2, 0)
    """
    return -(-int(tokens) // int(page_size))


def page_keys(tokens: Sequence[int], page_size: int, namespace: bytes = b"") -> list[bytes]:
    """Keys of the full pages of ``tokens``: key j digests key j - 1 and page j's tokens (BLAKE2b, 128 bits), so
    it names the whole prefix up to the page's end; ``namespace`` separates caches that must not mix.

    >>> a, b = page_keys([1, 2, 3, 4, 5], 2), page_keys([9, 2, 3, 4], 2)
    >>> len(a), a[1] == b[1], page_keys([1, 2, 3, 4], 2) == a
    (2, False, True)
    """
    keys, parent = [], namespace
    ids = np.asarray(tokens, np.int64)
    for j in range(len(ids) // page_size):
        parent = hashlib.blake2b(parent + ids[j * page_size:(j + 1) * page_size].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


def cached_run(tokens: Sequence[int], page_size: int, namespace: bytes, find) -> list:
    """What ``find(key)`` gives for the keys of ``tokens``' leading full pages, up to the first None, leaving at
    least the last token out (its logits give the next token, so it is always computed).

    >>> index = dict(zip(page_keys([1, 2, 3, 4], 2), ["p", "q"]))
    >>> cached_run([1, 2, 3, 4, 5], 2, b"", index.get), cached_run([1, 2, 3, 4], 2, b"", index.get)
    (['p', 'q'], ['p'])
    """
    if len(tokens) < 2:
        return []
    found = []
    for key in page_keys(tokens[: len(tokens) - 1], page_size, namespace):
        value = find(key)
        if value is None:
            break
        found.append(value)
    return found


class PagePool:
    """Pages of one pool (every layer of the target and the drafter share the page ids), over ``num_slots``
    slots of at most ``pages_per_slot`` pages each.

    >>> pool = PagePool(num_pages=6, page_size=4, num_slots=2, pages_per_slot=4)
    >>> pool.reserve(0, 10), pool.ensure(0, 5), pool.block_tables[0, :2].tolist(), pool.free_pages
    (True, True, [0, 1], 3)
    >>> pool.reserve(1, 16), pool.release(0), pool.free_pages
    (False, None, 6)

    With a prefix cache, a second request with the same first page attaches it:

    >>> pool = PagePool(num_pages=6, page_size=4, num_slots=2, pages_per_slot=4, prefix_caching=True)
    >>> _ = pool.reserve(0, 9), pool.ensure(0, 9), pool.publish(0, [7, 7, 7, 7, 8, 8, 8, 8, 9])
    >>> pages = pool.lookup([7, 7, 7, 7, 8, 8, 1, 1])  # one full page in common
    >>> pages, pool.reserve(1, 8, shared=pages), pool.attach(1, pages), int(pool.refs[pages[0]])
    ([0], True, None, 2)
    """

    def __init__(self, *, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int,
                 contiguous: bool = False, prefix_caching: bool = False):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("num_slots", num_slots),
                        ("pages_per_slot", pages_per_slot)):
            if int(v) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
        if contiguous and num_pages < num_slots * pages_per_slot:
            raise ValueError(f"a contiguous pool needs num_slots x pages_per_slot = {num_slots * pages_per_slot} "
                             f"pages, got {num_pages}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.num_slots, self.pages_per_slot = int(num_slots), int(pages_per_slot)
        self.contiguous = bool(contiguous)
        if prefix_caching and contiguous:
            raise ValueError("prefix_caching shares pages between slots: a contiguous pool (fixed pages per slot) "
                             "cannot")
        self.prefix_caching = bool(prefix_caching)
        self.refs = np.zeros(num_pages, np.int64)  # block-table entries holding each page (non-contiguous pools)
        self._page_of: dict[bytes, int] = {}  # published key -> page
        self._key_of: dict[int, bytes] = {}  # page -> its published key
        self._cached: OrderedDict[int, None] = OrderedDict()  # published pages nobody holds, oldest first
        self.evictions = 0
        # Unallocated entries point at page 0: a valid page that no live position of the slot reads.
        self.block_tables = np.zeros((num_slots, pages_per_slot), np.int32)
        if self.contiguous:
            self.block_tables[:] = np.arange(num_slots * pages_per_slot, dtype=np.int32).reshape(num_slots, -1)
        self.held = np.zeros(num_slots, np.int64)  # pages allocated to each slot
        self.reserved = np.zeros(num_slots, np.int64)  # pages promised to each slot's request (>= held)
        # A stack, the lowest ids on top (a contiguous pool only counts: each slot's pages are fixed).
        self._free = [] if self.contiguous else list(range(num_pages - 1, -1, -1))
        self._free_count = num_pages
        self.version = 0  # bumped whenever a block table changes (the device copy is refreshed then)

    # ------------------------------------------------------------------ counts
    @property
    def cached_pages(self) -> int:
        """Published pages no request holds (evictable)."""
        return len(self._cached)

    @property
    def free_pages(self) -> int:
        """Pages neither allocated nor promised (cached pages count: they are evicted when needed)."""
        return int(self._free_count - (self.reserved - self.held).sum())

    @property
    def used_pages(self) -> int:
        """Pages allocated to slots."""
        return int(self.held.sum())

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one slot can hold."""
        return self.pages_per_slot * self.page_size

    def fits(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` positions could ever be admitted (an empty pool would hold it)."""
        need = pages_for(tokens, self.page_size)
        return need <= self.pages_per_slot and need <= self.num_pages

    # ------------------------------------------------------------------ slots
    def reserve(self, slot: int, tokens: int, shared: Sequence[int] = ()) -> bool:
        """Promise ``slot`` (empty) the pages of ``tokens`` positions, of which ``shared`` (from `lookup`, to be
        `attach`-ed next) exist already; False, changing nothing, when the pool cannot back them now.
        ValueError when it never could (`fits`)."""
        if self.reserved[slot] or self.held[slot]:
            raise ValueError(f"reserve: slot {slot} still holds a request (release it first)")
        if not self.fits(tokens):
            raise ValueError(f"reserve: {tokens} tokens need {pages_for(tokens, self.page_size)} pages of "
                             f"{self.page_size}; a slot holds at most {self.pages_per_slot} and the pool "
                             f"{self.num_pages}")
        need = pages_for(tokens, self.page_size)
        # a shared page someone holds costs nothing; a cached one leaves the evictable pages
        new = need - sum(1 for p in shared if self.refs[p] > 0)
        if new > self.free_pages:
            return False
        self.reserved[slot] = need
        return True

    def lookup(self, tokens: Sequence[int], namespace: bytes = b"") -> list[int]:
        """Pages holding the longest run of ``tokens``' full pages that is published, leaving at least the last
        token to compute (its logits give the next token): attach them instead of prefilling them."""
        if not self.prefix_caching:
            return []
        return cached_run(tokens, self.page_size, namespace, self._page_of.get)

    def attach(self, slot: int, pages: Sequence[int]) -> None:
        """``slot`` (reserved, holding nothing yet) starts with ``pages``, shared and read-only."""
        if self.held[slot]:
            raise ValueError(f"attach: slot {slot} already holds pages")
        for j, page in enumerate(pages):
            if self.refs[page] == 0:  # a cached page is taken out of the evictable ones
                self._cached.pop(page)
                self._free_count -= 1
            self.refs[page] += 1
            self.block_tables[slot, j] = page
        self.held[slot] = len(pages)
        self.reserved[slot] = max(int(self.reserved[slot]), len(pages))
        if len(pages):
            self.version += 1

    def publish(self, slot: int, tokens: Sequence[int], namespace: bytes = b"") -> int:
        """Publish ``slot``'s full pages whose positions ``tokens`` (its committed tokens, from position 0)
        fill; a key already published keeps its page. Returns pages newly published."""
        if not self.prefix_caching:
            return 0
        keys = page_keys(tokens, self.page_size, namespace)[: int(self.held[slot])]
        added = 0
        for j, key in enumerate(keys):
            page = int(self.block_tables[slot, j])
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key] = page
            self._key_of[page] = key
            added += 1
        return added

    def _take(self) -> int:
        """A page for a slot to write: a never-used or evicted one, else the least recently cached (evicted)."""
        if self._free:
            return self._free.pop()
        page, _ = self._cached.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.evictions += 1
        return page

    def ensure(self, slot: int, tokens: int) -> bool:
        """Allocate pages so that ``slot``'s first ``tokens`` positions are backed (within its reservation,
        past it only while free pages remain). Returns whether the block table changed."""
        need = pages_for(tokens, self.page_size)
        have = int(self.held[slot])
        if need <= have:
            return False
        if need > self.pages_per_slot:
            raise ValueError(f"ensure: slot {slot} needs {need} pages, more than pages_per_slot "
                             f"{self.pages_per_slot}")
        extra = max(0, need - int(self.reserved[slot]))  # beyond the promise: only from truly free pages
        if extra > self.free_pages:
            raise RuntimeError(f"ensure: slot {slot} needs {need} pages, {extra} past its reservation, and the "
                               f"pool has {self.free_pages} free")
        for j in range(have, need):
            if not self.contiguous:
                page = self._take()
                self.refs[page] = 1
                self.block_tables[slot, j] = page
        self._free_count -= need - have
        self.held[slot] = need
        self.reserved[slot] = max(int(self.reserved[slot]), need)
        if not self.contiguous:
            self.version += 1
        return not self.contiguous

    def release(self, slot: int) -> None:
        """Return every page of ``slot`` and its reservation to the pool."""
        have = int(self.held[slot])
        if not self.contiguous:
            for page in reversed(self.block_tables[slot, :have].tolist()):
                self.refs[page] -= 1
                if self.refs[page] > 0:  # another request still reads it
                    continue
                self._free_count += 1
                if page in self._key_of:  # stays cached until the pool needs it
                    self._cached[page] = None
                else:
                    self._free.append(page)
        else:
            self._free_count += have
        self.held[slot] = 0
        self.reserved[slot] = 0
        if not self.contiguous and have:
            self.block_tables[slot, :have] = 0
            self.version += 1

    def check(self) -> None:
        """Invariants (tests): every page is free, cached or held, and held pages are counted by references."""
        held = [int(p) for s in range(self.num_slots) for p in self.block_tables[s, : self.held[s]]]
        assert (self.reserved >= self.held).all() and self.free_pages >= 0
        if self.contiguous:
            assert len(set(held)) == len(held) and len(held) + self._free_count == self.num_pages, "pages lost"
            return
        counts = np.bincount(np.asarray(held, np.int64), minlength=self.num_pages)
        assert (counts == self.refs).all(), "references do not count the block tables"
        if not self.prefix_caching:
            assert counts.max(initial=0) <= 1, "a page is held twice without a prefix cache"
        in_use, free, cached = set(held), set(self._free), set(self._cached)
        assert not (in_use & free) and not (in_use & cached) and not (free & cached), "a page in two states"
        assert len(in_use) + len(free) + len(cached) == self.num_pages, "pages lost"
        assert self._free_count == len(free) + len(cached)
        assert set(self._key_of) >= cached and not (set(self._key_of) & free), "the index and the pages disagree"
        assert all(self._key_of[p] == k for k, p in self._page_of.items())
