"""Page allocator for per-request decode state (host-side: plain Python, no torch, no device).

Memory for decode state is a budget of `num_pages` equal pages of `page_bytes` each. Every kind
of state (`dspark.engine.footprint`) is paged separately: a page of kind k holds
`page_bytes // row_bytes_k` of its rows, so one request owns, per kind, a list of pages large
enough for the rows it holds. All kinds draw from one pool, so a budget is never split ahead of
time between kinds whose mix depends on the context length (window rows are bounded, compressed
entries grow with it). One page size for every kind is what lets a device pool be a single
byte buffer that each kind views with its own row shape.

    pool      [p0 p1 p2 p3 p4 p5 p6 p7 ...]            free pages: a stack of released ids +
    request a   window_kv: [p0 p3]  compressed_kv: [p1]  never-used ids from `_fresh` upwards
    request b   window_kv: [p2]     compressed_kv: []   ...

`StateAllocator.resize(owner, length, fed)` sets an owner's page lists to exactly what its state
needs at `length` tokens after a call of `fed` (growing or shrinking each kind, newest pages
released first), all or nothing: when the pool cannot supply the growth it changes nothing and
returns False, and the caller (the scheduler) decides whom to preempt.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

from dspark.engine.footprint import StateFootprint


class PagePool:
    """`num_pages` page ids, each either free or held by exactly one owner."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._released: list[int] = []  # ids handed back, reused first (LIFO keeps the pool compact)
        self._fresh = 0  # ids >= _fresh were never handed out: large pools cost nothing until used
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return self.num_pages - len(self._used)

    @property
    def used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """`n` free page ids; ValueError when fewer are free (callers check `free` first)."""
        if n > self.free:
            raise ValueError(f"allocate: {n} pages requested, {self.free} free")
        pages = [self._released.pop() for _ in range(min(n, len(self._released)))]
        while len(pages) < n:
            pages.append(self._fresh)
            self._fresh += 1
        self._used.update(pages)
        return pages

    def release(self, pages: list[int]) -> None:
        """Return held pages; ValueError naming a page that is not held (double free)."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"release: page {p} is not allocated")
            self._used.remove(p)
            self._released.append(p)

    def check(self) -> None:
        """Every id is in exactly one of {used, released, never used}; RuntimeError otherwise."""
        released = set(self._released)
        _require(len(released) == len(self._released), "a page was released twice")
        _require(not released & self._used, "a page is both free and used")
        _require(all(0 <= p < self._fresh for p in released | self._used), "page id out of range")
        _require(len(released) + len(self._used) == self._fresh <= self.num_pages, "pages lost")


class StateAllocator:
    """Page lists per owner (a request) and per kind of state, over one `PagePool`.

    Parameters
    ----------
    footprint : the kinds of state one request holds.
    num_pages : pages in the budget.
    page_bytes : bytes per page; at least the largest row of any kind.
    """

    def __init__(self, footprint: StateFootprint, num_pages: int, page_bytes: int):
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes < footprint.max_row_bytes:
            raise ValueError(f"page_bytes must be an int >= the largest state row "
                             f"({footprint.max_row_bytes} bytes), got {page_bytes!r}")
        self.footprint = footprint
        self.page_bytes = page_bytes
        self.rows_per_page = tuple(page_bytes // k.row_bytes for k in footprint.kinds)
        self.pool = PagePool(num_pages)
        self._tables: dict[Hashable, list[list[int]]] = {}
        # The scheduler asks twice per running request per step; with hundreds of requests the
        # per-kind arithmetic was the largest host cost of a decode step. The answer depends only
        # on (length, fed) (the footprint is frozen), and a decode batch shares few distinct keys.
        self._pages_needed = functools.lru_cache(maxsize=4096)(self._count_pages)

    def _count_pages(self, length: int, fed: int) -> tuple[int, ...]:
        return tuple(-(-rows // per) for rows, per in zip(self.footprint.rows(length, fed), self.rows_per_page))

    def pages_needed(self, length: int, fed: int = 0) -> tuple[int, ...]:
        """Pages per kind for one request at `length` after a call of `fed` tokens (ceil division)."""
        return self._pages_needed(length, fed)

    def fits_alone(self, length: int, fed: int = 0) -> bool:
        """Whether one request at this size fits the whole budget."""
        return sum(self.pages_needed(length, fed)) <= self.pool.num_pages

    def held(self, owner: Hashable) -> int:
        return sum(map(len, self._tables.get(owner, ())))

    def owners(self) -> list[Hashable]:
        return list(self._tables)

    def resize(self, owner: Hashable, length: int, fed: int = 0) -> bool:
        """Make `owner` hold exactly `pages_needed(length, fed)`; a new owner starts with nothing.

        Returns False, changing nothing, when the pool lacks the pages for the growth.
        """
        return self._set(owner, self.pages_needed(length, fed))

    def settle(self, owner: Hashable, length: int, keep: tuple[int, ...]) -> bool:
        """Shrink `owner` to what its state needs at `length` (`pages_needed(length)`), except that of
        each kind it keeps up to `keep` of the pages it holds (its next call's need: releasing pages
        only to take them back at once costs host time and frees nothing). False as `resize`."""
        table = self._tables.get(owner)
        if table is not None and all(k == len(pages) for k, pages in zip(keep, table)):
            return True  # the usual decode step: it holds its next call's pages (need grows with length)
        held = [len(pages) for pages in table] if table is not None else [0] * len(self.rows_per_page)
        return self._set(owner, tuple(max(n, min(h, k)) for n, h, k in zip(self.pages_needed(length), held, keep)))

    def _set(self, owner: Hashable, need: tuple[int, ...]) -> bool:
        """Make `owner` hold exactly `need` pages per kind, all or nothing (False: the pool lacks the growth)."""
        table = self._tables.get(owner) or [[] for _ in self.rows_per_page]
        if owner in self._tables and all(n == len(pages) for n, pages in zip(need, table)):
            return True  # the common decode case: no kind crosses a page boundary this step
        grow = sum(max(0, n - len(pages)) for n, pages in zip(need, table))
        if grow > self.pool.free:
            return False
        for n, pages in zip(need, table):
            if n < len(pages):
                self.pool.release(pages[n:])
                del pages[n:]
            elif n > len(pages):
                pages.extend(self.pool.allocate(n - len(pages)))
        self._tables[owner] = table
        return True

    def release(self, owner: Hashable) -> int:
        """Give back every page of `owner` (unknown owners hold none); returns how many."""
        table = self._tables.pop(owner, [])
        for pages in table:
            self.pool.release(pages)
        return sum(map(len, table))

    def check(self) -> None:
        """Pool invariants, and every used page held by exactly one (owner, kind)."""
        self.pool.check()
        held = [p for table in self._tables.values() for pages in table for p in pages]
        _require(len(held) == len(set(held)), "a page is held twice")
        _require(set(held) == self.pool._used, "held pages and used pages differ")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"page allocator invariant broken: {what}")
