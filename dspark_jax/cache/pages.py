"""The page pool's host side: which pages each request slot holds, allocated as its tokens are written.

A slot's block table row lists its pages in position order (page j holds positions ``j * page_size`` ..
``(j + 1) * page_size - 1``); the device programs read the table, the host writes it. Pages are taken from
a free list when a slot's tokens reach them (`PagePool.ensure`) and returned when its request ends
(`PagePool.release`). A request is admitted only when the pool can back its whole budget (prompt, answer
and one verification block beyond): the pages are *reserved* at admission (`PagePool.reserve`) and
allocated only as tokens arrive, so a running request never waits for a page and nothing needs preempting,
while pages a request never reaches stay free for the prefix cache and for requests that stop early to give
back.

``contiguous`` pools give slot ``s`` the fixed pages ``s * pages_per_slot + j``: the block table is the
identity and the pool, reshaped, is one dense run per slot, read in place by the CPU's XLA path (a gather of
pages costs XLA:CPU several times the attention's own read; docs/design.md). Allocation is then only counted.

Axis legend: S slots, N pages per slot (``pages_per_slot``), P pages in the pool, ps page size.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PagePool", "pages_for"]


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that back ``tokens`` positions.

    >>> pages_for(17, 16), pages_for(0, 16)
    (2, 0)
    """
    return -(-int(tokens) // int(page_size))


class PagePool:
    """Pages of one pool (every layer of the target and the drafter share the page ids), over ``num_slots``
    slots of at most ``pages_per_slot`` pages each.

    >>> pool = PagePool(num_pages=6, page_size=4, num_slots=2, pages_per_slot=4)
    >>> pool.reserve(0, 10), pool.ensure(0, 5), pool.block_tables[0, :2].tolist(), pool.free_pages
    (True, True, [0, 1], 3)
    >>> pool.reserve(1, 16), pool.release(0), pool.free_pages
    (False, None, 6)
    """

    def __init__(self, *, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int,
                 contiguous: bool = False):
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
    def free_pages(self) -> int:
        """Pages neither allocated nor promised."""
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
    def reserve(self, slot: int, tokens: int) -> bool:
        """Promise ``slot`` (empty) the pages of ``tokens`` positions; False, changing nothing, when the pool
        cannot back them now. ValueError when it never could (`fits`)."""
        if self.reserved[slot] or self.held[slot]:
            raise ValueError(f"reserve: slot {slot} still holds a request (release it first)")
        if not self.fits(tokens):
            raise ValueError(f"reserve: {tokens} tokens need {pages_for(tokens, self.page_size)} pages of "
                             f"{self.page_size}; a slot holds at most {self.pages_per_slot} and the pool "
                             f"{self.num_pages}")
        need = pages_for(tokens, self.page_size)
        if need > self.free_pages:
            return False
        self.reserved[slot] = need
        return True

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
                self.block_tables[slot, j] = self._free.pop()
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
            self._free.extend(reversed(self.block_tables[slot, :have].tolist()))
        self._free_count += have
        self.held[slot] = 0
        self.reserved[slot] = 0
        if not self.contiguous and have:
            self.block_tables[slot, :have] = 0
            self.version += 1

    def check(self) -> None:
        """Invariants (tests): every page either free or held by exactly one slot."""
        held = [int(p) for s in range(self.num_slots) for p in self.block_tables[s, : self.held[s]]]
        assert len(set(held)) == len(held), "a page is held twice"
        assert len(held) + self._free_count == self.num_pages, "pages lost"
        if not self.contiguous:
            assert not set(held) & set(self._free), "a held page is also free"
            assert self._free_count == len(self._free)
        assert (self.reserved >= self.held).all() and self.free_pages >= 0
