"""Forward graphs kept for their backward: a bounded store, keyed by caller and token.

A caller that asked its forward to keep its graph gets a token and sends it back with
its backward. Tokens are per caller (a peer can only use its own), entries expire after
``ttl_seconds`` and the oldest go first past ``max_entries``: a caller that never comes
back costs at most one entry for a bounded time. Pure: every call takes ``now``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Generic, TypeVar

from peers.identity import PeerID

T = TypeVar("T")


class KeptStore(Generic[T]):
    def __init__(self, *, max_entries: int, ttl_seconds: float) -> None:
        if max_entries < 0 or ttl_seconds < 0:
            raise ValueError("max_entries and ttl_seconds must be >= 0")
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._entries: OrderedDict[tuple[PeerID, int], tuple[float, T]] = OrderedDict()
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, caller: PeerID, value: T, now: float) -> int:
        """Keep ``value`` for ``caller``; its token (0 if the store keeps nothing)."""
        self._expire(now)
        if self.max_entries == 0:
            return 0
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)
        token = next(self._tokens)
        self._entries[(caller, token)] = (now, value)
        return token

    def take(self, caller: PeerID, token: int, now: float) -> T | None:
        """The value ``caller`` kept under ``token`` (removed), or None if there is none
        (never kept, expired, evicted, or someone else's)."""
        self._expire(now)
        entry = self._entries.pop((caller, token), None)
        return None if entry is None else entry[1]

    def _expire(self, now: float) -> None:
        while self._entries:
            stored, _ = next(iter(self._entries.values()))
            if now - stored <= self.ttl_seconds:
                return
            self._entries.popitem(last=False)
