"""``specfleet plan`` and the plan at the start of ``specfleet run``: a price before the first request,
and a run that cannot work refused before anything is paid for (real simulator over HTTP)."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from common import keys
from common.config import load_config
from common.datasets import ReadStats, read_prompts
from common.errors import ConfigError
from harness import zygote
from harness.warm import kept_between_tests
from producer.plan import ByteShape, PendingPlan, byte_shape, start_plan
from tests.fleet import DEMO_TOKENIZER, REPO, TEST_KEY, Fleet, free_port, prompts, write_jsonl

DEMO_CONFIG = REPO / "demo" / "fleet.toml"
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


#: A plan's answer (its table, or why it refuses) comes a few seconds after the CLI starts here (the
#: tokenizer's load, counts of at most 41 prompts): an answer missing past this is the behaviour
#: under test failing (the counts never reaching the run, a refusal that does not end it), asserted
#: as such, not left to a subprocess timeout minutes later.
ANSWER_S = 60.0
#: A run that goes on to completion (at most 40 prompts; one test's answers take 4 s each).
RUN_S = 120.0


def _cli(fleet: Fleet, *args: str, base_url: str | None = None, pythonpath: Path | None = None,
         within_s: float = ANSWER_S) -> subprocess.CompletedProcess[str]:
    env = fleet.env(OPENROUTER_BASE_URL=base_url or fleet.sim_url)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    try:
        return zygote.run([sys.executable, "-m", "producer.cli", *args], env=env, cwd=REPO, timeout=within_s)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"specfleet {args[0]} did not end within {within_s:.0f} s: the plan's answer never "
                             f"reached it\n--- stdout\n{exc.stdout}\n--- stderr\n{str(exc.stderr)[-6000:]}") from None


def _answered(pending: PendingPlan, within_s: float = ANSWER_S) -> PendingPlan:
    """``pending`` once its counts are in (or failed): ``settle`` would otherwise wait for ever."""
    deadline = time.monotonic() + within_s
    while not pending.done():
        assert time.monotonic() < deadline, f"the plan's counts gave no answer within {within_s:.0f} s"
        time.sleep(0.05)
    return pending


def _prompt_tokens(path: Path) -> list[int]:
    """The definition: the template with the generation prompt, tokenized, per prompt."""
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    out = []
    for p in read_prompts(path, [], ReadStats()):
        ids = tok.apply_chat_template(p.messages, tools=p.tools, add_generation_prompt=True, tokenize=True)
        out.append(len(ids["input_ids"] if not isinstance(ids, list) else ids))
    return out


def _row(stdout: str, name: str) -> list[str]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith(name + " "))
    return line.split()


def test_plan_prices_the_demo_config_and_sends_nothing(fleet: Fleet) -> None:
    fleet.start_simulator()
    fleet.sim_config(price_in_per_mtok=1.25, price_out_per_mtok=7.5, price_request_usd=0.001)
    # OpenRouter's documented base URL form (…/api/v1) is accepted as well as the bare host.
    out = _cli(fleet, "plan", str(DEMO_CONFIG), base_url=fleet.sim_url + "/api/v1/")
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert "context 262,144 · $1.25/M prompt · $7.50/M completion · $0.001/request" in out.stdout
    p_in, p_out, p_req = 1.25e-6, 7.5e-6, 0.001
    totals = {"rows": 0, "expected": 0.0, "worst": 0.0}
    for name, data, budget, max_tokens in (("B1_glaive", "b1_glaive.jsonl", 400_000, 2048),
                                           ("B4_mixturethoughts", "b4_mixturethoughts.jsonl", 10_000_000, 16384)):
        counts = _prompt_tokens(REPO / "demo" / "data" / data)
        expect = max_tokens // 4  # the demo sets no estimate_tokens
        rows = min(len(counts), math.ceil(budget / expect))
        per_request = sum(counts) / len(counts) * p_in + p_req
        expected, worst = rows * (per_request + expect * p_out), rows * (per_request + max_tokens * p_out)
        assert _row(out.stdout, name) == [name, f"{len(counts):,}", f"{sum(counts):,}", f"{max_tokens:,}",
                                          f"{expect:,}", f"{rows:,}", f"${expected:,.2f}", f"${worst:,.2f}"]
        totals["rows"] += rows
        totals["expected"] += expected
        totals["worst"] += worst
    total = _row(out.stdout, "total")
    assert total[-3:] == [f"{totals['rows']:,}", f"${totals['expected']:,.2f}", f"${totals['worst']:,.2f}"]
    assert fleet.sim_stats()["requests"] == 0


def _one_dataset(fleet: Fleet, rows: list[dict[str, object] | str], *, head: str = "",
                 model: str | None = None) -> Path:
    data = write_jsonl(fleet.tmp / "b1.jsonl", rows)
    # A head's [run] table goes into the harness' own (a run file has one).
    run, _, rest = head.partition("\n\n") if head.startswith("[run]\n") else ("", "", head)
    config = fleet.write_config([{"name": "B1", "path": data, "length": "short"}], run=run.removeprefix("[run]\n"))
    text = config.read_text()
    if model:
        text = text.replace('name = "moonshotai/kimi-k2.5"', f'name = "{model}"')
    config.write_text(rest + text)
    return config


def test_run_refuses_an_unknown_model_before_any_request(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator()
    config = _one_dataset(fleet, prompts(5), model="moonshotai/kimi-k9")
    out = _cli(fleet, "run", str(config), "--no-progress")
    assert out.returncode == 2, out.stdout + out.stderr
    assert (f"[model] name 'moonshotai/kimi-k9' is not a model at {fleet.sim_url}/api/v1/models "
            "(1 models listed) (did you mean moonshotai/kimi-k2.5?)") in out.stderr
    assert "Traceback" not in out.stderr
    assert fleet.sim_stats()["requests"] == 0
    # nothing enqueued, no run started (the keys a warm worker of an earlier test keeps aside)
    assert [k for k in redis_client.scan_iter() if not kept_between_tests(k)] == []


def test_a_prompt_that_cannot_fit_the_context_is_named_and_nothing_is_sent(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator()
    rows: list[dict[str, object] | str] = [*prompts(2), {"id": "long", "messages": [
        {"role": "user", "content": "Summarise: " + " ".join(f"word{i}" for i in range(600))}]}, *prompts(2, "q")]
    config = _one_dataset(fleet, rows)
    n_long = _prompt_tokens(fleet.tmp / "b1.jsonl")[2]
    # max_tokens of the short class is 1024 in the test config: the long prompt fits exactly at
    # n_long + 1024 and by one token too many below that.
    fleet.sim_config(context_length=n_long + 1024)
    fits = _cli(fleet, "plan", str(config))
    assert fits.returncode == 0, fits.stderr
    fleet.sim_config(context_length=n_long + 1023)
    out = _cli(fleet, "run", str(config), "--no-progress")
    assert out.returncode == 2, out.stdout + out.stderr
    problems = [ln.strip() for ln in out.stderr.splitlines() if "prompt_too_long" in ln]
    assert problems == [f"B1: prompt_too_long: {fleet.tmp / 'b1.jsonl'}:3 ({n_long:,} prompt tokens + max_tokens "
                        f"1,024 > context {n_long + 1023:,})"]
    assert fleet.sim_stats()["requests"] == 0
    queue = keys.DatasetKeys("B1").queue
    assert redis_client.llen(queue) == 0 and not redis_client.hexists(keys.ACTIVE_QUEUES, queue)


def _long_prompt(words: int) -> dict[str, object]:
    return {"id": "long", "messages": [
        {"role": "user", "content": "Summarise: " + " ".join(f"word{i}" for i in range(words))}]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("refusal", ["over_budget", "too_long"])
def test_a_refused_plan_sends_nothing_though_workers_took_and_prepared_its_prompts(
    fleet: Fleet, redis_client: redis.Redis, refusal: str
) -> None:
    """The counts run while the first prompts are queued and workers prepare them, every request held
    by the fleet-wide throttle (the files' bytes cannot rule a refusal out here): a refusal still
    sends nothing, leaves nothing queued, and the prompts workers hold end without an outcome, so
    the run after the fix asks every one exactly once."""
    fleet.start_simulator("--latency-median-ms", "50")
    k = keys.DatasetKeys("B1")
    if refusal == "over_budget":
        # 40 prompts, 1024 max_tokens at $2.50/M: worst ≈ $0.10 against a run budget of $0.05.
        config = _one_dataset(fleet, prompts(40), head="[run]\nbudget_usd = 0.05\n\n")
        fix = "[run]\nbudget_usd = 0.5\n\n"
    else:
        # 40 prompts that fit and, last, one that cannot fit prompt + max_tokens (1024) in the context.
        config = _one_dataset(fleet, [*prompts(40), _long_prompt(600)])
        fleet.sim_config(context_length=_prompt_tokens(fleet.tmp / "b1.jsonl")[40] + 1023)
        fix = ""
    fleet.start_worker("w1", concurrency=10)
    fleet.wait_ready("w1")
    # Counts as slow as a first tokenizer download: the worker takes prompts before the refusal.
    out = _cli(fleet, "run", str(config), "--no-progress", pythonpath=_plan_load_hook(fleet.tmp, slow_s=3.0))
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(r"^total ", out.stdout, re.M)
    if refusal == "over_budget":
        assert "exceeds [run] budget_usd $0.05" in out.stderr, out.stderr
    else:
        assert f"B1: prompt_too_long: {fleet.tmp / 'b1.jsonl'}:41" in out.stderr, out.stderr
    # Not vacuous: the worker had prompts admitted and waiting for the throttle during the plan.
    assert re.search(r"B1/\S+ reserve: ok", fleet.log("w1")), fleet.log("w1")
    assert redis_client.llen(k.queue) == 0 and not redis_client.hexists(keys.ACTIVE_QUEUES, k.queue)
    deadline = time.monotonic() + 20  # a held prompt looks at its dataset every 5 s (gate keepalive)
    while redis_client.hlen(k.leases) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert redis_client.hlen(k.leases) == 0
    assert fleet.sim_stats()["requests"] == 0
    assert redis_client.scard(k.done) == 0 and redis_client.hlen(k.failed) == 0
    fleet.run_producer(_one_dataset(fleet, prompts(40), head=fix))  # the fix: a budget, or the long prompt out
    fleet.assert_exactly_once(redis_client, "B1", 40)
    assert fleet.sim_stats()["billed_requests"] == 40


# Loaded into the producer only (sitecustomize on its PYTHONPATH): the plan's tokenizer load
# writes when it began to STAMP (if given), then takes SLOW_S, as a first download from the hub does.
_PLAN_LOAD_HOOK = '''
import sys
import time

sys.path.insert(0, REPO)  # this checkout's producer, as `python -m` from it would import
import producer.plan

_load = producer.plan.load_tokenizer


def _hooked_load(*args, **kwargs):
    if STAMP is not None:
        with open(STAMP, "w") as f:
            f.write(repr(time.time()))
    time.sleep(SLOW_S)
    return _load(*args, **kwargs)


producer.plan.load_tokenizer = _hooked_load
'''


def _plan_load_hook(tmp_path: Path, *, slow_s: float = 0.0, stamp: Path | None = None) -> Path:
    """A PYTHONPATH folder whose sitecustomize hooks the plan's tokenizer load (``_PLAN_LOAD_HOOK``)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_PLAN_LOAD_HOOK.replace("SLOW_S", repr(slow_s)).replace(
        "STAMP", repr(None if stamp is None else str(stamp))).replace("REPO", repr(str(REPO))))
    return site


SLOW_PLAN_S = 8.0


@pytest.mark.timeout(240)
def test_requests_start_before_slow_counts_when_the_files_bytes_rule_out_a_refusal(
    fleet: Fleet, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """No prompt's line, counted a token per byte (twice over, plus the template's framing), can
    overflow the context, and the worst case so counted is within budget_usd: the counts cannot
    refuse, so requests start without waiting for them; the plan is still printed once they are in."""
    site = _plan_load_hook(tmp_path, slow_s=SLOW_PLAN_S)
    fleet.start_simulator("--latency-median-ms", "50")
    config = _one_dataset(fleet, prompts(30), head="[run]\nbudget_usd = 5\n\n")
    fleet.start_worker("w1", concurrency=10)
    fleet.wait_ready("w1")
    started = time.time()
    out = _cli(fleet, "run", str(config), "--no-progress", pythonpath=site, within_s=RUN_S)
    assert out.returncode == 0, out.stdout + out.stderr
    fleet.assert_exactly_once(redis_client, "B1", 30)
    assert re.search(r"^total ", out.stdout, re.M)  # the plan, printed when its counts came in
    log_text = out.stderr
    early = re.search(r"requests start [\d.]+ s after the start, before the plan's counts: every prompt has at "
                      r"most [\d,]+ tokens", log_text)
    passed = re.search(r"plan passed ([\d.]+) s after the start: requests had started already", log_text)
    assert early and passed and early.start() < passed.start(), log_text
    assert float(passed.group(1)) >= SLOW_PLAN_S  # not vacuous: the counts really were slow
    # Every answer was in before the counts were: the first request did not wait for them.
    answered = [r["end_s"] for r in fleet.sim_requests() if r["status"] == 200]
    assert len(answered) == 30 and max(answered) < started + SLOW_PLAN_S, (max(answered) - started, log_text)


@pytest.mark.timeout(240)
def test_counts_the_byte_bound_made_optional_wait_for_the_first_wave_to_leave(
    fleet: Fleet, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """Once the byte bound has cleared the run, the counts only print the plan: they start when the
    run's requests stop ramping up (here: all 30 in flight for the simulator's 4 s), not beside
    them, nor at the run's end or their fallback (COUNTS_WAIT_MAX_S)."""
    stamp = tmp_path / "counts-started"
    site = _plan_load_hook(tmp_path, stamp=stamp)
    fleet.start_simulator("--latency-median-ms", "4000", "--latency-p99-ms", "4000")
    config = _one_dataset(fleet, prompts(30))
    fleet.start_worker("w1", concurrency=50)
    fleet.wait_ready("w1")
    out = _cli(fleet, "run", str(config), "--no-progress", pythonpath=site, within_s=RUN_S)
    assert out.returncode == 0, out.stdout + out.stderr
    fleet.assert_exactly_once(redis_client, "B1", 30)
    assert re.search(r"^total ", out.stdout, re.M)  # the plan, printed all the same
    wave = re.search(r"^(\S+ \S+) INFO .*the first wave has left [\d.]+ s after the start \((\d+) in flight\): "
                     r"the plan's counts start", out.stderr, re.M)
    assert wave and int(wave.group(2)) == 30, out.stderr
    wave_t = datetime.strptime(wave.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    counts_t = float(stamp.read_text())
    first_answer_t = min(r["end_s"] for r in fleet.sim_requests() if r["status"] == 200)
    assert wave_t - 0.05 <= counts_t < first_answer_t, (wave_t, counts_t, first_answer_t)


def test_a_worst_case_over_the_run_budget_needs_yes(fleet: Fleet) -> None:
    fleet.start_simulator()
    # 40 prompts of ~40 tokens, 1024 max_tokens at $2.50/M: worst ≈ 40 × 1024 × 2.5e-6 ≈ $0.10.
    over = '[run]\nbudget_usd = 0.05\n\n'
    config = _one_dataset(fleet, prompts(40), head=over)
    refused = _cli(fleet, "plan", str(config))
    assert refused.returncode == 2
    worst = re.search(r"^total .* \$(\d+\.\d\d)$", refused.stdout, re.M)
    assert worst and 0.05 < float(worst.group(1)) < 0.2, refused.stdout
    assert f"worst case ${worst.group(1)} exceeds [run] budget_usd $0.05" in refused.stderr
    assert "--yes" in refused.stderr
    assert _cli(fleet, "plan", str(config), "--yes").returncode == 0
    flagged = _one_dataset(fleet, prompts(40), head=over.replace("\n\n", "\nconfirm_over_budget = true\n\n"))
    assert _cli(fleet, "plan", str(flagged)).returncode == 0
    enough = _one_dataset(fleet, prompts(40), head=over.replace("0.05", "0.5"))
    assert _cli(fleet, "plan", str(enough)).returncode == 0
    assert fleet.sim_stats()["requests"] == 0


def test_without_the_models_endpoint_plans_warn_unless_a_dollar_budget_needs_prices(fleet: Fleet) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    fleet.sim_url = nowhere
    out = _cli(fleet, "plan", str(_one_dataset(fleet, prompts(3))), base_url=nowhere)
    assert out.returncode == 0, out.stderr
    assert f"price and context length unknown (GET {nowhere}/api/v1/models: ConnectionError)" in out.stdout
    assert re.search(r"^B1 +3 +[\d,]+ +1,024 +256 +3 +\? +\?$", out.stdout, re.M), out.stdout
    dollars = _cli(fleet, "plan", str(_one_dataset(fleet, prompts(3), head="[run]\nbudget_usd = 5\n\n")),
                   base_url=nowhere)
    assert dollars.returncode == 2
    assert "[run] budget_usd needs the price of model 'moonshotai/kimi-k2.5', which is unknown" in dollars.stderr


@pytest.mark.timeout(240)
def test_run_hands_the_models_context_length_and_prices_to_the_workers(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator()
    fleet.sim_config(price_in_per_mtok=1.25, price_out_per_mtok=7.5, price_request_usd=0.001,
                     context_length=100_000)
    fleet.start_worker("w1", concurrency=10)
    config = _one_dataset(fleet, prompts(5))
    log = fleet.run_producer(config)
    assert "context 100,000 · $1.25/M prompt · $7.50/M completion · $0.001/request" in log
    run = json.loads(redis_client.get(keys.CURRENT_RUN))
    view = json.loads(redis_client.get(keys.config(run["config_id"])))
    assert view["model"]["context_length"] == 100_000
    assert view["model"]["pricing"] == {"prompt": 1.25e-6, "completion": 7.5e-6, "request": 0.001}
    fleet.assert_exactly_once(redis_client, "B1", 5)


def test_a_5mb_line_and_bad_content_are_reported_in_malformed_jsonl_and_never_sent(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    rows: list[dict[str, object] | str] = [*prompts(4, "g")]
    rows[1] = {"id": "huge", "messages": [{"role": "user", "content": "x" * 5_000_000}]}
    rows[2] = {"id": "ints", "messages": [{"role": "user", "content": [1, 2]}]}
    rows.append({"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}]})
    config = _one_dataset(fleet, rows)
    data = fleet.tmp / "b1.jsonl"
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config)
    bad = [json.loads(x) for x in (fleet.out / "B1" / "malformed.jsonl").read_text().splitlines()]
    assert [(b["where"], b["reason"]) for b in bad] == [
        (f"{data}:2", f"line_too_long ({len(json.dumps(rows[1])):,} bytes > 1,000,000)"),
        (f"{data}:3", "messages[0].content[0]: a part must be an object like {'type': 'text', 'text': ...}, not int"),
    ]
    kept = {r["id"]: r for r in fleet.assert_exactly_once(redis_client, "B1", 3)}
    assert set(kept) == {"g00000", "g00003", "parts"}
    stats = fleet.sim_stats()
    assert stats["requests"] == 3 and stats["billed_prompt_tokens"] < 3 * 200  # the 5 MB prompt never went


def test_a_sampled_dataset_still_names_every_prompt_that_cannot_fit(tmp_path: Path) -> None:
    """Above the exact limit only a sample is counted, yet a long prompt outside it is still found."""
    from common.config import load_config
    from common.prompt_tokens import load_tokenizer
    from producer.plan import plan_dataset

    rows: list[dict[str, object] | str] = [*prompts(50)]
    rows[36] = {"id": "long", "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(3000))}]}
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    config = tmp_path / "fleet.toml"
    config.write_text(f'[model]\nname = "m"\ntokenizer = "{DEMO_TOKENIZER}"\ncontext_length = 3000\n\n'
                      f'[lengths.short]\nmax_tokens = 1000\ntimeout_s = 10\n\n'
                      f'[[datasets]]\nname = "D"\npath = "{data}"\n')
    cfg = load_config(config)
    tokenizer = load_tokenizer(str(DEMO_TOKENIZER), trust_remote_code=False)
    plan = plan_dataset(cfg, cfg.datasets[0], tokenizer, None, exact_limit=1)
    assert (plan.prompts, plan.counted, plan.sampled) == (50, 1, True)
    assert [t.split(" (")[0] for t in plan.too_long] == [f"{data}:37"]
    exact = plan_dataset(cfg, cfg.datasets[0], tokenizer, None)
    assert exact.too_long == plan.too_long and not exact.sampled


@pytest.mark.long
def test_the_plan_reads_the_same_counted_in_a_forked_process_or_in_a_thread(fleet: Fleet) -> None:
    """`specfleet` counts in a forked process (its only thread at the start); a process with threads
    (this test's) counts in a thread: one plan either way, and a count's error reaches the caller."""
    fleet.start_simulator()
    config = _one_dataset(fleet, [*prompts(30), {"id": "t", "messages": [{"role": "user", "content": "x"}],
                                                 "tools": [{"type": "function", "function": {"name": "f"}}]}])
    forked = _cli(fleet, "plan", str(config))
    assert forked.returncode == 0, forked.stderr
    another = threading.Event()  # a second thread: this process counts in a thread, wherever it runs
    threading.Thread(target=another.wait, daemon=True).start()
    try:
        out = io.StringIO()
        # The CLI reads the account with the fleet's key: so does this plan, or its account line is missing.
        _, pending = start_plan(load_config(config), fleet.sim_url, yes=False, api_key=TEST_KEY)
        _answered(pending).settle(out)
    finally:
        another.set()
    # The CLI's own line after the plan (Redis memory, when REDIS_URL is set) is not the plan's.
    plan_lines = "".join(line for line in forked.stdout.splitlines(keepends=True)
                         if not line.startswith("Redis memory:"))
    assert out.getvalue() == plan_lines
    broken = config.read_text().replace(f'tokenizer = "{DEMO_TOKENIZER}"', 'tokenizer = "/nonexistent/tok"')
    assert broken != config.read_text()
    config.write_text(broken)
    cli = _cli(fleet, "plan", str(config))
    assert cli.returncode == 2 and "cannot load tokenizer '/nonexistent/tok'" in cli.stderr, cli.stderr
    _, pending = start_plan(load_config(config), fleet.sim_url, yes=False)
    with pytest.raises(ConfigError, match="cannot load tokenizer '/nonexistent/tok'"):
        _answered(pending).settle(io.StringIO())


def test_the_byte_shape_reads_lines_across_chunks_and_leaves_out_lines_a_run_refuses(tmp_path: Path) -> None:
    """The bound rests on the longest line a run may send and the lines' bytes: read in 1 MiB
    chunks, a line straddling two chunks is one line, and one over ``max_line_bytes`` (refused as
    line_too_long, never sent) does not count as the longest."""
    sizes = [10, 1_048_570, 30, 2_000_000, 7, 5]  # the second line ends past the first chunk's end
    path = tmp_path / "shape.jsonl"
    path.write_bytes(b"".join(b"x" * n + b"\n" for n in sizes[:-1]) + b"y" * sizes[-1])  # no final newline
    shape = byte_shape(path, max_line_bytes=1_500_000)
    assert shape == ByteShape(lines=6, bytes=sum(sizes) + 5, longest=1_048_570)
    assert byte_shape(path, max_line_bytes=3_000_000).longest == 2_000_000
