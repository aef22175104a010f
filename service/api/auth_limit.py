"""Failed credential attempts per source (the client address): after `PEAGLE_AUTH_FAILURES_MAX` wrong or
revoked API keys within a window of `PEAGLE_AUTH_FAILURES_WINDOW_S`, that address is answered 429 with
Retry-After until the window ends, a right key included (else guessing would go on, only slower). Other
addresses are never affected, so an attacker cannot lock a key's owner out from elsewhere. The API's
bearer check and the dashboard's sign-in share one limiter.

Counting is a fixed window per source: a counter keyed by (source, window number). With
`PEAGLE_AUTH_FAILURES_STORE` auto (Redis when `PEAGLE_REDIS_URL` is set) or redis, every API process
shares the counters in Redis, each expiring with its window; when Redis is unreachable the process counts
in memory meanwhile, so authentication never depends on Redis. In memory, at most `MAX_SOURCES` sources
are tracked (least recently failed dropped first): bounded, whatever the number of addresses.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from redis import Redis
from redis.exceptions import RedisError

from service.api.errors import ApiError
from service.settings import Settings

log = logging.getLogger("peagle.api")

MAX_SOURCES = 10_000
_PREFIX = "peagle:auth-failures:"


class FailureStore(Protocol):
    def count(self, source: str, window: int) -> int: ...

    def add(self, source: str, window: int, ttl_s: int) -> int: ...


class MemoryStore:
    """Counters in this process: source -> (window, failures), at most `max_sources` of them."""

    def __init__(self, max_sources: int = MAX_SOURCES):
        self.max_sources = max_sources
        self._counts: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()  # sync routes run on a thread pool

    def count(self, source: str, window: int) -> int:
        with self._lock:
            seen = self._counts.get(source)
            return seen[1] if seen is not None and seen[0] == window else 0

    def add(self, source: str, window: int, ttl_s: int) -> int:
        with self._lock:
            seen = self._counts.pop(source, None)
            n = (seen[1] if seen is not None and seen[0] == window else 0) + 1
            self._counts[source] = (window, n)
            while len(self._counts) > self.max_sources:
                self._counts.popitem(last=False)
            return n

    def __len__(self) -> int:
        return len(self._counts)


class RedisStore:
    """Counters in Redis, shared by every API process; in memory while Redis is unreachable.

    After a Redis error the store counts in memory for `retry_s` before it tries Redis again: every
    authenticated request consults the counters, and none should wait on a dead Redis's timeout."""

    def __init__(self, redis: Redis, fallback: MemoryStore | None = None, retry_s: float = 30.0):
        self.redis = redis
        self.fallback = fallback or MemoryStore()
        self.retry_s = retry_s
        self._down_until = 0.0  # monotonic time; a racy read only retries Redis a little early

    @staticmethod
    def _key(source: str, window: int) -> str:
        return f"{_PREFIX}{source}:{window}"

    def _redis_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _went_down(self, exc: RedisError) -> None:
        log.warning("auth failure counters: redis unavailable (%s); counting in memory", type(exc).__name__)
        self._down_until = time.monotonic() + self.retry_s

    def count(self, source: str, window: int) -> int:
        local = self.fallback.count(source, window)
        if not self._redis_up():
            return local
        try:
            value = self.redis.get(self._key(source, window))
        except RedisError as exc:
            self._went_down(exc)
            return local
        return max(int(value or 0), local)

    def add(self, source: str, window: int, ttl_s: int) -> int:
        if not self._redis_up():
            return self.fallback.add(source, window, ttl_s)
        key = self._key(source, window)
        try:
            pipe = self.redis.pipeline()
            pipe.incr(key)
            pipe.expire(key, ttl_s)
            n, _ = pipe.execute()
            return int(n)
        except RedisError as exc:
            self._went_down(exc)
            return self.fallback.add(source, window, ttl_s)


class AuthLimiter:
    """Refuse a source with too many recent failures (`check`), and count a failure (`failed`)."""

    def __init__(
        self, max_failures: int, window_s: int, store: FailureStore, clock: Callable[[], float] = time.time
    ):
        self.max_failures, self.window_s, self.store, self.clock = max_failures, window_s, store, clock

    @staticmethod
    def source_id(address: str) -> str:
        # Hashed: Redis keys and memory hold no client addresses.
        return hashlib.sha256(address.encode("utf-8", "backslashreplace")).hexdigest()[:32]

    def _window(self) -> tuple[int, float]:
        now = self.clock()
        window = int(now // self.window_s)
        return window, (window + 1) * self.window_s - now

    def check(self, address: str) -> None:
        """429 with Retry-After when `address` has used up its failures in this window."""
        window, left = self._window()
        if self.store.count(self.source_id(address), window) >= self.max_failures:
            retry = max(1, math.ceil(left))
            raise ApiError(
                429,
                f"too many failed API-key attempts from this address (limit PEAGLE_AUTH_FAILURES_MAX: "
                f"{self.max_failures} per {self.window_s} s); retry in {retry} s",
                code="too_many_auth_failures",
                headers={"Retry-After": str(retry)},
            )

    def failed(self, address: str) -> None:
        window, _ = self._window()
        # Kept a window past its end, so that clock skew between API processes cannot reset it early.
        self.store.add(self.source_id(address), window, 2 * self.window_s)


def build_limiter(settings: Settings, redis: Redis) -> AuthLimiter:
    """The limiter the settings ask for: counters in Redis (`auto` with a Redis URL, or `redis`), else in
    this process."""
    use_redis = settings.auth_failures_store == "redis" or (
        settings.auth_failures_store == "auto" and bool(settings.redis_url)
    )
    store: FailureStore = RedisStore(redis) if use_redis else MemoryStore()
    return AuthLimiter(settings.auth_failures_max, settings.auth_failures_window_s, store)


def client_address(scope_client: tuple[str, int] | None) -> str:
    """The request's source: its peer address (behind a proxy, run uvicorn with --proxy-headers and
    --forwarded-allow-ips so that this is the client's, not the proxy's)."""
    return scope_client[0] if scope_client else "unknown"
