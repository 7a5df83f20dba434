"""Who is asking, and how much of the server each one may hold.

A tenant is an API key (`ServeConfig.api_key` and `api_keys`), known by a name that never shows the key: the name a
key was given (`NAME:KEY`), else `key-` and the first 8 hex digits of its sha256. With no key, every client is the one
tenant "" (a local server's user).

With two keys or more, each tenant may hold at most `key_share` of the server at once (`Share`): of its rows, of its
queue and of its key/value cache budget, so that one key flooding the server leaves room for the others, whose
requests are then admitted as soon as a row is free. Among the tenants waiting, the next row goes to the one holding
the fewest rows (then to the earliest request); within a tenant, first come, first served. With one tenant this is the
plain first-come queue.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import math
import re
from dataclasses import dataclass

from verispec.errors import VerispecError

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def key_name(key: str) -> str:
    """The name a key is known by when it was given none: `key-` and the first 8 hex digits of its sha256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_keys(entries: tuple[str, ...]) -> tuple[tuple[str, bytes], ...]:
    """`KEY` or `NAME:KEY` entries -> ((name, key bytes), ...); a repeated key or name is one line."""
    keys: list[tuple[str, bytes]] = []
    for entry in entries:
        name, sep, key = entry.partition(":")
        if not sep or not NAME.fullmatch(name) or not key:
            name, key = key_name(entry), entry
        if not key.strip():
            raise VerispecError("an API key is empty")
        if any(key.encode() == k for _, k in keys):
            raise VerispecError(f"the API key named '{name}' is given twice")
        if any(name == n for n, _ in keys):
            raise VerispecError(f"two API keys are named '{name}'")
        keys.append((name, key.encode()))
    return tuple(keys)


class Keys:
    """The server's API keys: which tenant an Authorization header names (checked in constant time against every key)."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.keys = parse_keys(entries)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def tenant(self, authorization: bytes) -> str | None:
        """The tenant of 'Bearer <key>', or None when it names no key (always "" when the server has none)."""
        if not self.keys:
            return ""
        scheme, _, given = authorization.partition(b" ")
        given = given.strip()
        found = None
        for name, key in self.keys:  # every key compared, so the time does not say which one matched
            if hmac.compare_digest(given, key) and scheme.lower() == b"bearer":
                found = name
        return found


@dataclass(frozen=True)
class Share:
    """What one tenant may hold at once: rows of the batch, waiting requests, bytes of key/value cache reserved."""

    rows: int
    queue: int
    cache_bytes: int


def share_of(fraction: float | None, max_batch_size: int, max_queue: int, max_cache_bytes: int) -> Share | None:
    """Each tenant's share of the server (None: no per-tenant limit, as with a single tenant)."""
    if fraction is None:
        return None
    return Share(max(1, math.floor(fraction * max_batch_size)), max(1, math.floor(fraction * max_queue)),
                 max(1, math.floor(fraction * max_cache_bytes)))


class Ledger:
    """Per-tenant counts the scheduler keeps: requests waiting, rows running, cache reserved (decoding thread and
    event loop both read it; the scheduler's lock guards `waiting`)."""

    def __init__(self, share: Share | None) -> None:
        self.share = share
        self.waiting: collections.Counter[str] = collections.Counter()
        self.rows: collections.Counter[str] = collections.Counter()
        self.reserved: collections.Counter[str] = collections.Counter()

    def over_queue(self, tenant: str) -> bool:
        return self.share is not None and self.waiting[tenant] >= self.share.queue

    def over_cache(self, tenant: str, reserved: int) -> bool:
        """Whether a request reserving this much could never run within its tenant's share."""
        return self.share is not None and reserved > self.share.cache_bytes

    def may_run(self, tenant: str, reserved: int) -> bool:
        """Whether one more row of this tenant, reserving `reserved`, fits its share now."""
        share = self.share
        return share is None or (self.rows[tenant] < share.rows and self.reserved[tenant] + reserved <= share.cache_bytes)

    def started(self, tenant: str, reserved: int) -> None:
        self.rows[tenant] += 1
        self.reserved[tenant] += reserved

    def ended(self, tenant: str, reserved: int) -> None:
        self.rows[tenant] -= 1
        self.reserved[tenant] -= reserved
        if self.rows[tenant] <= 0:
            del self.rows[tenant], self.reserved[tenant]

    def pick(self, heads: list) -> object | None:
        """Of each waiting tenant's first ticket (in arrival order), the one to admit next: its tenant within its share,
        holding the fewest rows, earliest first; None when every tenant is at its share."""
        open_ = [t for t in heads if self.may_run(t.tenant, t.reserved)]
        return min(open_, key=lambda t: self.rows[t.tenant], default=None)
