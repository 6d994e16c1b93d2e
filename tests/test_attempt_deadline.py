"""``timeout_s`` bounds a whole attempt, however slowly the upstream's bytes come; no prompt is sent
again while an earlier attempt of it is open.

Real processes: the simulator trickles its answers (headers at once, then a byte every 0.25 s:
a per-read socket timeout never trips on that), two gevent workers call it with timeout_s = 3, and
the visibility timeout (10 s) is shorter than a prompt's attempts take, so kombu hands each
prompt's message to a worker again while its first delivery is still retrying. The simulator's own
request log says how long each request was open and whether two of a prompt's overlapped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import pytest
import redis
import requests

from simulator.run import start_in_thread
from simulator.settings import SimSettings
from tests.fleet import REPO, Fleet, prompts, read_rows, read_summary, write_jsonl

TIMEOUT_S = 3.0
TRICKLE_EVERY_S = 0.25
#: Beyond timeout_s: the simulator sees a closed connection at its next byte (0.25 s), plus a
#: slow shared box. The old per-read timeout held these requests open 40 s (the whole trickle).
SLACK_S = 2.0
MAX_ATTEMPTS = 4
#: Backoff between attempts: 1-2 s ("equal jitter" of 2 s), longer than the simulator takes to see
#: a closed connection, so requests that follow one another are never read as overlapping.
BACKOFF_S = 2.0


def _intervals(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    by_prompt: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        by_prompt[r["prompt"]].append((r["start_s"], r["end_s"]))
    return {p: sorted(v) for p, v in by_prompt.items()}


def test_a_trickling_upstream_cannot_hold_an_attempt_past_timeout_s(
    fleet: Fleet, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every process of the fleet with a visibility timeout shorter than a prompt's four attempts.
    short = {"SPECFLEET_VISIBILITY_TIMEOUT_S": "10", "SPECFLEET_UNACKED_RESTORE_S": "1"}
    env = fleet.env
    monkeypatch.setattr(fleet, "env", lambda **extra: env(**{**short, **extra}))
    fleet.start_simulator("--latency-median-ms", "20", "--trickle-every-s", str(TRICKLE_EVERY_S),
                          "--trickle-s", "40")
    rows: list[Any] = prompts(6, "t")
    kept, exhausted = {r["id"] for r in rows[:3]}, {r["id"] for r in rows[3:]}
    for i, r in enumerate(rows):  # the first three meet the trickle twice, the others every time
        trickles = 2 if r["id"] in kept else MAX_ATTEMPTS
        r["messages"][0]["content"] = f'#sim {json.dumps({"fail_attempts": ["trickle"] * trickles})} case-{i}'
    data = write_jsonl(fleet.tmp / "t.jsonl", rows)
    config = fleet.write_config([{"name": "T", "path": data, "length": "short", "budget_tokens": 10_000_000}],
                                timeout_s=TIMEOUT_S, max_attempts=MAX_ATTEMPTS)
    config.write_text(config.read_text().replace("backoff_base_s = 0.05", f"backoff_base_s = {BACKOFF_S}")
                      .replace("backoff_max_s = 0.5", f"backoff_max_s = {BACKOFF_S}"))
    fleet.start_worker("w1", concurrency=5)
    fleet.start_worker("w2", concurrency=5)

    fleet.run_producer(config, timeout_s=240)

    time.sleep(TRICKLE_EVERY_S * 4)  # a request cut last is logged at its next byte
    records = fleet.sim_requests()
    assert all(r["end_s"] is not None for r in records)
    by_prompt = _intervals(records)
    durations = [end - start for spans in by_prompt.values() for start, end in spans]
    # A request that starts before an earlier one of its prompt ended (spans are sorted by start).
    overlaps = [(p, s) for p, spans in by_prompt.items() for s in spans[1:]
                if s[0] < max(end for start, end in spans if start < s[0])]
    print(f"requests: {len(durations)} for {len(by_prompt)} prompts, longest {max(durations):.2f} s "
          f"(timeout_s {TIMEOUT_S:g}), sent while an earlier one was open: {len(overlaps)}")
    assert max(durations) <= TIMEOUT_S + SLACK_S, sorted(durations)
    assert not overlaps, overlaps
    # Each prompt asked once per attempt, not once more per redelivery.
    assert sorted(len(s) for s in by_prompt.values()) == [3, 3, 3, MAX_ATTEMPTS, MAX_ATTEMPTS, MAX_ATTEMPTS]

    got = {r["id"]: r for r in fleet.assert_exactly_once(redis_client, "T")}
    assert set(got) == kept and all(r["attempts"] == 3 for r in got.values())
    failed = [json.loads(x) for x in (fleet.out / "T" / "failed.jsonl").read_text().splitlines()]
    assert {f["id"] for f in failed} == exhausted
    assert all(f["reason"] == "retries_exhausted" and f["attempts"] == MAX_ATTEMPTS for f in failed), failed
    assert all("timeout" in f["detail"] for f in failed), failed
    summary = read_summary(fleet.out, "T")
    assert summary["results"] == 3 and summary["failed"] == 3
    assert read_rows(fleet.out, "T")


_CLIENT = """
from gevent import monkey; monkey.patch_all()
import json, sys, time
import requests
from common.errors import RetryableUpstreamError
from workers.upstreams.openrouter import OpenRouterClient
from workers.upstreams.upstream import Request

url, timeout_s = sys.argv[1], float(sys.argv[2])
client = OpenRouterClient(url, "sk-test", pool_size=1, app_url="x", app_title="t")
request = Request(model="moonshotai/kimi-k2.5", messages=[{"role": "user", "content": "q"}], tools=None,
                  max_tokens=40, params={}, timeout_s=timeout_s)
out = {}
t0 = time.monotonic()
try:
    client.complete(request)
    out["first"] = "answered"
except RetryableUpstreamError as exc:
    out["first"] = exc.reason
out["first_s"] = time.monotonic() - t0
requests.post(url + "/_sim/config", json={"rates": {"trickle": 0}}, timeout=5).raise_for_status()
answer = client.complete(request)  # the one pooled connection: a half-read one would garble this
out["second"] = answer.finish_reason
out["second_usage"] = answer.usage
print(json.dumps(out))
"""


def test_the_deadline_cuts_a_trickle_in_a_gevent_process_and_drops_its_connection() -> None:
    """The client as a worker runs it (gevent-patched): the deadline interrupts a read that is
    receiving bytes, and the next request on the same one-connection pool gets a clean answer."""
    sim_settings = SimSettings(port=0, latency_median_ms=0, trickle_every_s=0.2, trickle_s=30)
    with start_in_thread(sim_settings) as sim:
        sim.configure(rates={"trickle": 1.0})
        done = subprocess.run([sys.executable, "-c", _CLIENT, sim.url, "1.5"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["first"] == "timeout" and 1.5 <= out["first_s"] < 1.5 + SLACK_S, out
        assert out["second"] in ("stop", "length") and out["second_usage"]["completion_tokens"] > 0, out
        time.sleep(0.5)
        log = requests.get(sim.url + "/_sim/requests", timeout=5).json()["requests"]
        assert [r["status"] for r in log] == [200, 200]
        assert log[0]["end_s"] - log[0]["start_s"] < 1.5 + SLACK_S  # the simulator saw it cut
        assert sim.stats()["abandoned_requests"] == 1  # billed in full, as a non-streamed answer is


def test_a_trickle_sends_headers_at_once_then_a_byte_at_a_time_plain_and_streamed() -> None:
    """The fault itself, over real HTTP: what a client's per-read timeout sees."""
    sim_settings = SimSettings(port=0, latency_median_ms=0, trickle_every_s=0.2, trickle_s=1.0)
    body = {"model": "moonshotai/kimi-k2.5", "messages": [{"role": "user", "content": "q"}], "max_tokens": 30}
    with start_in_thread(sim_settings) as sim:
        sim.configure(rates={"trickle": 1.0})
        for stream in (False, True):
            t0 = time.monotonic()
            resp = requests.post(sim.api_base + "/chat/completions", json={**body, "stream": stream},
                                 headers={"Authorization": "Bearer k"}, stream=True, timeout=(5, 0.5))
            headers_s = time.monotonic() - t0
            arrivals = []
            chunks = []
            for chunk in resp.raw.stream(1, decode_content=True):
                arrivals.append(time.monotonic() - t0)
                chunks.append(chunk)
            raw = b"".join(chunks)
            assert resp.status_code == 200 and headers_s < 0.5
            # A byte every 0.2 s for a second (a 0.5 s read timeout never trips), then the rest.
            assert 4 <= sum(a < 0.9 for a in arrivals) <= 7, arrivals[:10]
            assert arrivals[-1] >= 0.9
            if stream:
                assert raw.rstrip().endswith(b"data: [DONE]") and b'"usage"' in raw
            else:
                assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
        assert sim.stats()["faults"] == {"trickle": 2}
