"""``FlakyStorage``: a real backend whose writes sometimes fail, before or after taking effect.

A failure after the write is a lost acknowledgement: the data is durable but the caller sees an
error, as with a timeout or a dropped connection. Writers must sort out what happened from the
storage itself.
"""

from __future__ import annotations

import random

from storage_adapters.errors import StorageError


class InjectedFault(StorageError):
    """A failure injected by a test."""


class FlakyStorage:
    """Delegates to ``inner``; ``append``/``create`` fail with probability ``rate`` each way.
    ``lose_first_ack``: the first write takes effect and its acknowledgement is lost, whatever
    the dice say (a test that must see a lost acknowledgement is then not left to chance)."""

    def __init__(self, inner, rate: float, seed: int | None = None, *, lose_first_ack: bool = False):
        self._inner = inner
        self._rate = rate
        self._random = random.Random(seed)
        self._lose_next_ack = lose_first_ack
        self.lost_acks = self.failed_writes = 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _write(self, operation, *args, **options):
        roll = self._random.random()
        if self._lose_next_ack:
            self._lose_next_ack, roll = False, self._rate  # succeeds, then loses its acknowledgement
        if roll < self._rate:
            self.failed_writes += 1
            raise InjectedFault("injected: the write timed out before reaching storage")
        operation(*args, **options)
        if roll < 2 * self._rate:
            self.lost_acks += 1
            raise InjectedFault("injected: the write succeeded but its acknowledgement was lost")

    def append(self, path, position, data, **options):
        self._write(self._inner.append, path, position, data, **options)

    def create(self, path, data):
        self._write(self._inner.create, path, data)
