"""The simulator's Batch API (simulator/batch.py) against shared/reference/openrouter.md's "Batch API"."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from simulator import SimHandle, SimSettings, start_in_thread

KEY = {"Authorization": "Bearer sk-or-v1-test"}
MODEL = "moonshotai/kimi-k2.5"
FAST = SimSettings(port=0, latency_median_ms=0, batch_validate_s=0.3, batch_run_s=0.6, batch_finalize_s=0.1,
                   models=(MODEL, "other/no-batch"), batch_models=(MODEL,))


@pytest.fixture
def sim() -> Iterator[SimHandle]:
    with start_in_thread(FAST) as handle:
        yield handle


def _requests(n: int, prefix: str = "c", **body: Any) -> list[dict[str, Any]]:
    return [{"custom_id": f"{prefix}{i}", "body": {"messages": [{"role": "user", "content": f"question {prefix}{i}"}],
                                                    "max_tokens": 300, **body}} for i in range(n)]


def _post(sim: SimHandle, reqs: list[dict[str, Any]], model: str = MODEL,
          raw: bytes | None = None) -> requests.Response:
    data = raw if raw is not None else json.dumps({"endpoint": "/v1/chat/completions", "model": model,
                                                   "requests": reqs}).encode()
    return requests.post(sim.api_base + "/batches", headers=KEY, data=data, timeout=10)


def _wait_terminal(sim: SimHandle, batch_id: str, timeout_s: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    while time.monotonic() < deadline:
        b = requests.get(f"{sim.api_base}/batches/{batch_id}", headers=KEY, timeout=10).json()
        if not seen or seen[-1] != b["status"]:
            seen.append(b["status"])
        if b["status"] in ("completed", "failed", "expired"):
            b["seen"] = seen
            return b
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} not terminal: {seen}")


def _all_results(sim: SimHandle, batch_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = ""
    while True:
        page = requests.get(f"{sim.api_base}/batches/{batch_id}/results", params={"limit": "3", "cursor": cursor},
                            headers=KEY, timeout=10).json()
        out += page["data"]
        if not page["has_more"]:
            return out
        cursor = str(page["next_cursor"])


def test_a_batch_runs_through_its_statuses_pages_its_results_and_bills_half(sim: SimHandle) -> None:
    before = time.time()
    r = _post(sim, _requests(7))
    assert r.status_code == 202 and r.json()["status"] == "validating"
    b = _wait_terminal(sim, r.json()["id"])
    assert b["seen"][0] == "validating" and "in_progress" in b["seen"] and b["seen"][-1] == "completed"
    assert b["request_counts"] == {"total": 7, "completed": 7, "failed": 0}
    results = _all_results(sim, b["id"])
    assert sorted(x["custom_id"] for x in results) == sorted(f"c{i}" for i in range(7)) and len(b["results"]) == 7
    for x in results:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = x["response"]["body"]
        assert body["id"].startswith("gen-batch-") and "cost" not in body["usage"]  # per-result cost: undocumented
    # The batch's usage.cost: every answer at half the live price the models list publishes.
    models = {m["id"]: m for m in requests.get(sim.api_base + "/models", timeout=5).json()["data"]}
    live, batch = models[MODEL]["pricing"], models[MODEL + ":batch"]["pricing"]
    assert float(batch["completion"]) == pytest.approx(float(live["completion"]) / 2)
    assert "other/no-batch:batch" not in models
    usage = [x["response"]["body"]["usage"] for x in results]
    expected = sum(u["prompt_tokens"] * float(batch["prompt"]) + u["completion_tokens"] * float(batch["completion"])
                   for u in usage)
    assert b["usage"]["cost"] == pytest.approx(expected, rel=1e-9)
    # Listed newest first, filtered by creation time; deletable once terminal.
    listed = requests.get(sim.api_base + "/batches", params={"created_after": before - 1}, headers=KEY,
                          timeout=5).json()
    assert [x["id"] for x in listed["data"]] == [b["id"]]
    assert requests.get(sim.api_base + "/batches", params={"created_after": time.time() + 5}, headers=KEY,
                        timeout=5).json()["data"] == []
    assert requests.delete(f"{sim.api_base}/batches/{b['id']}", headers=KEY, timeout=5).status_code == 200
    assert requests.get(f"{sim.api_base}/batches/{b['id']}", headers=KEY, timeout=5).status_code == 404


def test_no_cancel_and_no_delete_while_running(sim: SimHandle) -> None:
    batch_id = _post(sim, _requests(3)).json()["id"]
    assert requests.post(f"{sim.api_base}/batches/{batch_id}/cancel", headers=KEY, timeout=5).status_code == 404
    assert requests.delete(f"{sim.api_base}/batches/{batch_id}", headers=KEY, timeout=5).status_code == 409
    assert _wait_terminal(sim, batch_id)["status"] == "completed"  # it ran anyway, and was billed
    assert sim.stats()["billed_requests"] == 3
    # Once terminal it can be purged: gone from the API, still counted by the simulator's stats.
    assert requests.delete(f"{sim.api_base}/batches/{batch_id}", headers=KEY, timeout=5).json()["deleted"] is True
    assert requests.get(f"{sim.api_base}/batches/{batch_id}", headers=KEY, timeout=5).status_code == 404
    assert batch_id not in {b["id"] for b in requests.get(f"{sim.api_base}/batches", headers=KEY,
                                                           timeout=5).json()["data"]}
    stats = requests.get(f"{sim.url}/_sim/batches", timeout=5).json()
    assert stats["deleted"] == 1 and stats["batches"] == 1 and stats["by_status"] == {"completed": 1}


def test_one_invalid_request_fails_the_whole_batch_naming_it_and_nothing_is_billed(sim: SimHandle) -> None:
    reqs = _requests(4)
    reqs[2]["body"]["max_tokens"] = 10_000_000  # beyond the context
    r = _post(sim, reqs)
    assert r.status_code == 202  # stored; validation comes after
    b = _wait_terminal(sim, r.json()["id"])
    assert b["status"] == "failed" and "c2" in b["error"]["message"], b
    assert sim.stats()["billed_requests"] == 0
    empty = _requests(2)
    empty[1]["body"]["messages"] = []
    assert "c1" in _wait_terminal(sim, _post(sim, empty).json()["id"])["error"]["message"]


def test_submission_refusals(sim: SimHandle) -> None:
    r = _post(sim, _requests(2), model="other/no-batch")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Model 'other/no-batch' does not have a :batch endpoint"
    assert _post(sim, _requests(5001)).status_code == 400
    late = json.dumps({"requests": _requests(1), "endpoint": "/v1/chat/completions", "model": MODEL}).encode()
    assert _post(sim, [], raw=late).status_code == 400  # model and endpoint after requests
    assert requests.post(sim.api_base + "/batches", data=b"{}", timeout=5).status_code == 401
    assert sim._control("GET", "/_sim/batches")["batches"] == 0


def test_per_request_errors_and_expiry_with_partial_results(sim: SimHandle) -> None:
    reqs = _requests(4)
    reqs[1]["body"]["messages"][0]["content"] = '#sim {"fail_attempts": [502]} broken'
    b = _wait_terminal(sim, _post(sim, reqs).json()["id"])
    assert b["status"] == "completed" and b["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    failed = [x for x in b["results"] if x["error"] is not None]
    assert [x["custom_id"] for x in failed] == ["c1"] and failed[0]["response"] is None
    assert sim.stats()["billed_requests"] == 3  # failed requests are not billed

    sim.configure(batch_expire_rate=1.0, batch_expire_done=0.5)
    b = _wait_terminal(sim, _post(sim, _requests(10, "e")).json()["id"])
    assert b["status"] == "expired" and b["request_counts"]["completed"] == 5 and len(_all_results(sim, b["id"])) == 5
    stats = sim._control("GET", "/_sim/batches")
    assert stats["by_status"] == {"completed": 1, "expired": 1} and stats["repeated_custom_ids"] == {}
    _post(sim, _requests(2, "e"))
    assert sim._control("GET", "/_sim/batches")["repeated_custom_ids"] == {"e0": 2, "e1": 2}
