"""Repeated failed API-key attempts from one address are refused (429 with Retry-After) until the window
ends, at the API and the dashboard's sign-in alike (one limiter), without locking the key's owner out from
another address; counters in Redis or in memory (bounded). The limiter's clock is the test's, so the
window passes without waiting."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.auth_limit import AuthLimiter, MemoryStore, RedisStore
from service.api.errors import ApiError
from tests.service.ui.test_ui import CSRF

MAX, WINDOW = 3, 60
START = 1000 * WINDOW + 1.0  # one second into a window: Retry-After is exactly WINDOW - 1


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
def limited(request, make_settings, redis_conn) -> tuple[Any, Clock]:
    from service.app import create_app

    settings = make_settings(
        auth_failures_max=MAX, auth_failures_window_s=WINDOW, auth_failures_store=request.param
    )
    app = create_app(settings)
    clock = Clock()
    app.state.auth_limiter.clock = clock
    return app, clock


def _from(app: Any, address: str) -> TestClient:
    # No lifespan (no `with`): the clients share the app's Redis connection and leave it open.
    return TestClient(
        app, base_url="http://localhost", client=(address, 40000), raise_server_exceptions=False
    )


def _get(client: TestClient, key: str) -> Any:
    return client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"})


def _sign_in(client: TestClient, key: str) -> Any:
    token = CSRF.search(client.get("/ui/login").text).group(1)
    return client.post("/ui/login", data={"api_key": key, "csrf_token": token}, follow_redirects=False)


def _assert_limited(r: Any) -> None:
    assert r.status_code == 429, r.text[:300]
    assert r.headers["Retry-After"] == str(WINDOW - 1)


@pytest.mark.parametrize("door", ["api", "ui"])
def test_failed_keys_from_one_address_are_refused_until_the_window_ends(limited, api_key, door) -> None:
    app, clock = limited
    attacker, owner = _from(app, "203.0.113.7"), _from(app, "198.51.100.2")
    attempt = _get if door == "api" else _sign_in
    wrong = "peagle_sk_guess"
    for _ in range(MAX):
        r = attempt(attacker, wrong)
        assert r.status_code == (401 if door == "api" else 200), r.text[:300]  # the form, with its error
    _assert_limited(attempt(attacker, wrong))
    _assert_limited(attempt(attacker, api_key))  # the right key too: guessing does not go on
    if door == "api":
        assert _get(attacker, api_key).json()["error"]["code"] == "too_many_auth_failures"
    else:
        assert "too many failed API-key attempts" in _sign_in(attacker, api_key).text

    # The owner, elsewhere, is not locked out, and has a counter of its own.
    assert _get(owner, api_key).status_code == 200
    assert _sign_in(owner, api_key).status_code == 303
    assert _get(owner, wrong).status_code == 401

    clock.now += WINDOW  # the next window: the address may try again
    assert _get(attacker, api_key).status_code == 200
    assert _sign_in(attacker, api_key).status_code == 303


def test_the_api_and_the_dashboard_share_one_count(limited) -> None:
    app, _ = limited
    attacker = _from(app, "203.0.113.8")
    assert _get(attacker, "peagle_sk_a").status_code == 401
    assert _sign_in(attacker, "peagle_sk_b").status_code == 200
    assert _get(attacker, "peagle_sk_c").status_code == 401
    _assert_limited(_sign_in(attacker, "peagle_sk_d"))
    _assert_limited(_get(attacker, "peagle_sk_e"))


def test_a_missing_key_is_not_a_failed_attempt(limited, api_key) -> None:
    app, _ = limited
    client = _from(app, "203.0.113.9")
    for _ in range(MAX + 2):
        assert client.get("/v1/jobs").status_code == 401
    assert _get(client, api_key).status_code == 200


@pytest.mark.parametrize("sources", [MAX + 1, 50])
def test_memory_counters_are_bounded(sources: int) -> None:
    store = MemoryStore(max_sources=MAX)
    limiter = AuthLimiter(1, WINDOW, store, clock=Clock())
    for i in range(sources):
        limiter.failed(f"10.0.0.{i}")
    assert len(store) == MAX
    with pytest.raises(ApiError, match="too many failed"):
        limiter.check(f"10.0.0.{sources - 1}")  # the most recent are the ones kept


def test_counting_goes_on_in_memory_while_redis_is_down() -> None:
    from redis import Redis

    down = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5, socket_timeout=0.5)
    limiter = AuthLimiter(MAX, WINDOW, RedisStore(down), clock=Clock())
    for _ in range(MAX):
        limiter.check("10.1.1.1")
        limiter.failed("10.1.1.1")
    with pytest.raises(ApiError, match="too many failed"):
        limiter.check("10.1.1.1")
    limiter.check("10.1.1.2")
