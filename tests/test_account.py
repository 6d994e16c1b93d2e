"""The account behind the key: the in-flight budget's 402s decided on their class, the throttle's
reading of them, the simulator's account (balance, estimates, the three 402s, /api/v1/key and
/api/v1/credits over HTTP) and what ``specfleet plan`` says and does with it."""

from __future__ import annotations

import io
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import requests

from common.config import load_config
from common.errors import AccountRefusedError, InFlightBudgetError, WeightExceedsBudgetError
from common.throttle import POLICY, FleetThrottle
from harness import zygote
from producer.account import fetch_account
from producer.plan import check_plan
from tests.fleet import REPO, TEST_KEY, Fleet
from tests.throttle_sim import T0_MS
from workers.pipeline.retry import RetryPolicy
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Request

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

TTL_MS = 60_000
#: The simulator's default price, USD per token.
PRICE_IN, PRICE_OUT = 0.6e-6, 2.5e-6

# --- the decision ------------------------------------------------------------------------------


def test_an_in_flight_budget_402_is_retried_after_its_retry_after_without_spending_an_attempt() -> None:
    policy = RetryPolicy(max_attempts=2)
    error = InFlightBudgetError("in_flight_budget_exhausted", "busy", status=402, retry_after_s=3.0)
    decision = policy.decide(error, attempt=2)  # the last attempt: a 429 here fails retries_exhausted
    assert decision.action == "retry" and not decision.spends_attempt
    assert 3.0 <= decision.delay_s <= 4.5


def test_an_in_flight_budget_402_fails_the_prompt_once_its_wait_would_pass_the_cap() -> None:
    policy = RetryPolicy(max_attempts=6, in_flight_wait_max_s=60.0)
    error = InFlightBudgetError("in_flight_budget_exhausted", "busy", status=402, retry_after_s=3.0)
    assert policy.decide(error, attempt=1, in_flight_waited_s=50.0).action == "retry"  # 53-54.5 s < 60
    fail = policy.decide(error, attempt=1, in_flight_waited_s=57.0)  # the next wait would end past 60 s
    assert (fail.action, fail.reason, fail.spends_attempt) == ("fail", "in_flight_budget_exhausted", False)


def test_weight_exceeds_budget_fails_the_prompt_at_once_and_other_402s_halt() -> None:
    policy = RetryPolicy(max_attempts=6)
    fail = policy.decide(WeightExceedsBudgetError("weight_exceeds_budget", "x", status=402), attempt=1)
    assert (fail.action, fail.reason) == ("fail", "weight_exceeds_budget")
    halt = policy.decide(AccountRefusedError("http_402", "no credits", status=402), attempt=1)
    assert (halt.action, halt.reason) == ("halt", "http_402")


# --- the throttle ------------------------------------------------------------------------------


def test_a_budget_402_cuts_the_fleets_limit_at_once_and_pauses_it(redis_client: redis.Redis) -> None:
    """Unlike a 429, no share is judged: the account refuses only what is over its balance. With
    the real policy, a 429 among ten requests is too few to call congestion; the 402 cuts."""
    now = [T0_MS]
    t = FleetThrottle(redis_client, clock_ms=lambda: now[0])
    slots = [f"s{i}" for i in range(10)]
    assert t.acquire_many(slots, ttl_ms=TTL_MS).granted == 10
    t.release(slots[0], "throttled", ttl_ms=TTL_MS, retry_after_s=1)
    assert t.snapshot().limit is None and t.snapshot().pause_ms_left == 0  # fewer than min_requests: no verdict
    now[0] += POLICY.cut_gap_ms
    t.release(slots[1], "budget", ttl_ms=TTL_MS, retry_after_s=2)
    snap = t.snapshot()
    assert snap.limit == int(POLICY.beta * 8) and snap.budget_refused == 1  # 9 in flight, one refused
    paused = t.acquire("new", ttl_ms=TTL_MS)
    assert not paused.ok and paused.why == "pause" and paused.wait_ms == 2000
    t.release(slots[2], "budget", ttl_ms=TTL_MS, retry_after_s=2)  # the same event: one less, no second cut
    assert t.snapshot().limit == int(POLICY.beta * 7)
    now[0] += 10 * POLICY.cut_gap_ms
    for s in slots[3:]:  # answers after the pause grow it as any limit grows; nothing undoes the cut
        t.release(s, "ok", ttl_ms=TTL_MS)
    limit = t.snapshot().limit
    assert limit is not None and int(POLICY.beta * 7) < limit < int(POLICY.beta * 7) + 1


def test_a_run_starts_its_limit_where_the_balance_puts_it(redis_client: redis.Redis) -> None:
    from common.config import ThrottleLimits

    t = FleetThrottle(redis_client)
    t.reset(ThrottleLimits(start_in_flight=37))
    assert t.snapshot().limit == 37
    assert t.acquire_many([f"s{i}" for i in range(50)], ttl_ms=TTL_MS).granted == 37
    t.reset(ThrottleLimits())
    assert t.snapshot().limit is None


def test_a_balance_bound_limit_shrinks_by_what_each_answer_spent(redis_client: redis.Redis) -> None:
    """The balance is spent as answers land, so the worst cases it covers shrink: an answer that
    cost half a worst case takes half a request off a limit the balance bounds (started from the
    balance's fit, or cut by its 402), and nothing off a limit it does not."""
    from common.config import ThrottleLimits
    from common.throttle import Release

    t = FleetThrottle(redis_client, clock_ms=lambda: T0_MS)
    t.reset(ThrottleLimits(start_in_flight=100))
    slots = [f"s{i}" for i in range(10)]
    t.acquire_many(slots, ttl_ms=TTL_MS)
    t.release_many([Release(s, "ok", TTL_MS, drain=0.5) for s in slots])
    assert t.snapshot().limit == 95  # ten in flight of 100: too few to grow it
    t.reset(ThrottleLimits(max_in_flight=100))  # a cap, not the balance: answers spend nothing off it
    t.acquire_many(slots, ttl_ms=TTL_MS)
    t.release_many([Release(s, "ok", TTL_MS, drain=0.5) for s in slots])
    assert t.snapshot().limit == 100


# --- the simulator's account, over HTTP ----------------------------------------------------------


def _request(max_tokens: int) -> Request:
    return Request(model="moonshotai/kimi-k2.5", messages=[{"role": "user", "content": "hello there"}],
                   tools=None, max_tokens=max_tokens, params={}, timeout_s=30)


def test_the_simulators_in_flight_budget_answers_its_three_402s_as_the_client_classifies_them(fleet: Fleet) -> None:
    fleet.start_simulator("--latency-median-ms", "1500", "--latency-p99-ms", "1600", "--balance-usd", "0.05")
    client = OpenRouterClient(fleet.sim_url, TEST_KEY, pool_size=8, app_url="https://x", app_title="t")
    # 8,192 at $2.5/M is ~$0.0205 a request: two fit beside each other under $0.05, a third does not.
    with ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(client.complete, _request(8192)) for _ in range(3)]
    errors = [j.exception() for j in jobs if j.exception() is not None]
    assert len(errors) == 1 and isinstance(errors[0], InFlightBudgetError), errors
    assert errors[0].retry_after_s == 1.0
    with pytest.raises(WeightExceedsBudgetError) as over:  # alone over what is left of the balance
        client.complete(_request(32_768))
    assert "max_tokens 32,768" in over.value.detail
    stats = fleet.sim_stats()
    billed = stats["billed_cost_usd"]
    assert stats["account"]["refused"] == {"in_flight_budget_exhausted": 1, "weight_exceeds_budget": 1,
                                           "insufficient_credits": 0}
    assert stats["account"]["holding"] == 0 and stats["account"]["held_usd"] == 0  # every estimate let go
    credits = requests.get(fleet.sim_url + "/api/v1/credits", headers={"Authorization": f"Bearer {TEST_KEY}"},
                           timeout=5).json()["data"]
    assert credits == {"total_credits": 0.05, "total_usage": pytest.approx(billed)}
    fleet.sim_config(balance_usd=billed)  # spent to the cent: out of credits, not a budget to wait for
    with pytest.raises(AccountRefusedError):
        client.complete(_request(16))


def test_the_credits_endpoint_needs_a_management_key_and_the_plan_reads_403_as_unknown(fleet: Fleet) -> None:
    fleet.start_simulator("--balance-usd", "30", "--management-key", "sk-or-mgmt", "--credit-limit-usd", "20")
    other = requests.get(fleet.sim_url + "/api/v1/credits", headers={"Authorization": f"Bearer {TEST_KEY}"},
                         timeout=5)
    assert other.status_code == 403
    account = fetch_account(fleet.sim_url, TEST_KEY)
    assert account.balance_usd is None and "403" in account.balance_unknown
    assert (account.key_limit_usd, account.key_remaining_usd, account.spendable_usd) == (20, 20, 20)
    managed = fetch_account(fleet.sim_url + "/api/v1", "sk-or-mgmt")  # the SDK's spelling of the base too
    assert (managed.balance_usd, managed.spendable_usd) == (30, 20), managed


def test_one_passing_upstream_hiccup_does_not_leave_the_plan_without_the_balance() -> None:
    """A real HTTP server whose first answer to each account route is a 503 (then a timeout for the
    credits route's second try in the second case): the first hiccup is asked again, a second one is
    reported as unknown, with why."""
    import http.server
    import json
    import threading

    seen: dict[str, int] = {}
    hang = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen[self.path] = seen.get(self.path, 0) + 1
            if seen[self.path] == 1 or (hang.is_set() and self.path.endswith("/credits")):
                body, status = b'{"error": {"code": 503, "message": "busy"}}', 503
            elif self.path.endswith("/credits"):
                body, status = json.dumps({"data": {"total_credits": 30, "total_usage": 4}}).encode(), 200
            else:
                body, status = json.dumps({"data": {"limit": 20, "limit_remaining": 15}}).encode(), 200
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}/api/v1"
        account = fetch_account(base, "sk-or-mgmt", timeout_s=5)
        assert (account.balance_usd, account.key_remaining_usd, account.spendable_usd) == (26, 15, 15), account
        assert seen == {"/api/v1/key": 2, "/api/v1/credits": 2}
        hang.set()
        again = fetch_account(base, "sk-or-mgmt", timeout_s=5)
        assert again.balance_usd is None and "HTTP 503" in again.balance_unknown, again
    finally:
        server.shutdown()


# --- the plan ------------------------------------------------------------------------------------


def _config(fleet: Fleet, n: int, *, max_tokens: int, request: str = "") -> Path:
    config = fleet.one_dataset("P", n, request=request)
    config.write_text(config.read_text().replace("max_tokens = 1024", f"max_tokens = {max_tokens}"))
    return config


def test_the_plan_shows_the_balance_and_starts_the_fleet_where_its_worst_cases_fit(fleet: Fleet) -> None:
    fleet.start_simulator("--balance-usd", "30", "--credit-limit-usd", "100")
    config = _config(fleet, 40, max_tokens=16_384)
    out = io.StringIO()
    applied = check_plan(load_config(config), fleet.sim_url, yes=False, out=out, api_key=TEST_KEY)
    text = out.getvalue()
    assert "account: balance $30.00 · key limit $100.00, $100.00 left · the key can spend $30.00" in text, text
    fit_line = next(line for line in text.splitlines() if line.startswith("in flight under the balance:"))
    fit = int(fit_line.split("P ", 1)[1].split(" ", 1)[0].replace(",", ""))
    # The counted mean prompt is a few dozen tokens: the fit is the balance over max_tokens' price, nearly.
    assert int(30 / (16_384 * PRICE_OUT + 200 * PRICE_IN)) <= fit <= int(30 / (16_384 * PRICE_OUT)), fit_line
    start = applied.request.start_in_flight
    # The start bounds each prompt from its file's bytes (requests may leave before the counts): at most the fit.
    assert start is not None and 0.95 * fit <= start <= fit, (start, fit)
    assert f"the fleet's in-flight limit starts at {start:,}" in fit_line
    capped = check_plan(load_config(_config(fleet, 40, max_tokens=16_384, request="max_in_flight = 50")),
                        fleet.sim_url, yes=False, out=io.StringIO(), api_key=TEST_KEY)
    assert capped.request.start_in_flight is None  # the run's own cap wins


def test_the_plan_refuses_a_worst_case_over_what_the_key_can_spend_unless_yes(fleet: Fleet) -> None:
    fleet.start_simulator("--balance-usd", "30", "--credit-limit-usd", "1")
    config = _config(fleet, 40, max_tokens=16_384)  # 40 worst cases: ~$1.64, over the key's $1 left
    env = fleet.env()
    refused = zygote.run([sys.executable, "-m", "producer.cli", "plan", str(config)], env=env, cwd=REPO, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "exceeds what the key can spend ($1.00" in refused.stderr and "--yes" in refused.stderr
    assert "the key can spend $1.00" in refused.stdout
    accepted = zygote.run([sys.executable, "-m", "producer.cli", "plan", str(config), "--yes"],
                          env=env, cwd=REPO, timeout=120)
    assert accepted.returncode == 0, accepted.stderr
