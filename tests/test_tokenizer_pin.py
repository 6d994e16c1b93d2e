"""One tokenizer per run, on every host (issue 35; common/tokenizer_pin.py).

A worker that sees other tokenizer files at the run's path (its own mount namespace, a real separate
process) refuses the run with one line and writes no row, while the matching worker completes it;
and a worker on whose "host" the producer's tokenizer path does not exist at all still makes the
run's rows, from the files the producer handed over through Redis.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from common import keys
from common.config import TokenizerPin
from common.contract import IDLE_QUEUE
from common.errors import TokenizerError
from common.manifest import read_manifest
from common.target import TargetTokenizer
from common.tokenizer_pin import HANDOFF_TTL_S, check, fetch, handoff_id
from common.worker_cmd import worker_argv
from harness.zygote import Process
from producer.validate import validate
from tests.fleet import DEMO_TOKENIZER, Fleet, read_rows, read_summary, write_jsonl

N_PROMPTS = 60
#: A run killed after its first row: enough left for the resumed run.
KILLED_RUN_PROMPTS = 200

needs_namespaces = pytest.mark.skipif(
    subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0,
    reason="needs unshare -m (root, or user namespaces): a worker with a private view of the files")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _other_template(folder: Path) -> None:
    """The same tokenizer with one extra space in its chat template (in the default system prompt)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    assert "You are Kimi, an" in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace("You are Kimi, an", "You are Kimi,  an")
    path.write_text(json.dumps(config, indent=2))


def _worker_in_namespace(fleet: Fleet, name: str, setup: str, args: list[str], *queues: str, **env: str) -> Process:
    """A worker (as ``specfleet worker`` starts it, also consuming ``queues`` if given) in a mount
    namespace of its own, after ``setup`` (a shell line given ``args`` as $1…) changed what that
    namespace sees: another host's files."""
    extra = ("-n", f"{name}@%h", *(("-Q", ",".join([IDLE_QUEUE, *queues])) if queues else ()))
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{setup} && shift {len(args)} && exec "$@"',
           "sh", *args, *worker_argv(10, extra=extra)]
    return fleet._spawn(name, cmd, fleet.env(SPECFLEET_CONCURRENCY="10", **env))


def _prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"t{i:05d}", "messages": [{"role": "user", "content": f"Question {i}, said plainly ✓"}]}
            for i in range(n)]


def _config(fleet: Fleet, tokenizer: Path, n: int = N_PROMPTS) -> Path:
    data = write_jsonl(fleet.tmp / "t.jsonl", _prompts(n))
    return fleet.write_config([{"name": "T", "path": data, "length": "short"}], tokenizer=tokenizer)


def _assert_rows_are_the_manifests(fleet: Fleet, n: int = N_PROMPTS) -> None:
    """Every prompt has its row, and each row's ids are what the manifest's tokenizer makes of it."""
    result = validate(fleet.out)
    assert result.ok, [str(d) for d in result.defects[:5]]
    assert sorted(row["id"] for row in read_rows(fleet.out, "T")) == [p["id"] for p in _prompts(n)]


def _one_refusal(fleet: Fleet, name: str, tok: Path, other: Path) -> None:
    """The worker's log says it once, naming the file and both hashes (short)."""
    refusals = [line for line in fleet.log(name).splitlines() if "refusing run" in line]
    assert len(refusals) == 1, fleet.log(name)
    short = (_sha(tok / "tokenizer_config.json")[:12], _sha(other / "tokenizer_config.json")[:12])
    assert "tokenizer_config.json" in refusals[0] and f"here {short[1]}, manifest {short[0]}" in refusals[0], refusals


@pytest.mark.fleet
@needs_namespaces
@pytest.mark.timeout(300)
def test_a_worker_seeing_other_tokenizer_files_at_the_run_path_refuses_with_one_line_and_writes_no_row(
        fleet: Fleet, tmp_path: Path) -> None:
    tok, other = tmp_path / "tok", tmp_path / "other"
    shutil.copytree(DEMO_TOKENIZER, tok)
    shutil.copytree(DEMO_TOKENIZER, other)
    _other_template(other)
    # The difference matters: the other files render the run's prompts into other ids.
    messages = _prompts(1)[0]["messages"]
    assert (TargetTokenizer.load(str(tok), trust_remote_code=False).prompt_ids(messages, None)
            != TargetTokenizer.load(str(other), trust_remote_code=False).prompt_ids(messages, None))
    fleet.start_simulator("--latency-median-ms", "40")
    config = _config(fleet, tok)
    # Told to load locally, where its namespace shows the other files at the run's path.
    stranger = _worker_in_namespace(fleet, "stranger", 'mount --bind "$1" "$2"', [str(other), str(tok)],
                                    SPECFLEET_TOKENIZER_FROM="local")
    fleet.start_worker("w1", concurrency=10)
    fleet.wait_ready("stranger")
    fleet.wait_ready("w1")
    fleet.run_producer(config, timeout_s=150)

    fleet.wait_for(lambda: stranger.poll() is not None, 30, "the refusing worker to leave")
    _one_refusal(fleet, "stranger", tok, other)
    assert "following specfleet.q.T" not in fleet.log("stranger")
    _assert_rows_are_the_manifests(fleet)


@pytest.mark.fleet
@needs_namespaces
@pytest.mark.timeout(300)
def test_a_worker_still_following_the_queue_of_a_killed_run_refuses_its_resumption_with_other_files(
        fleet: Fleet, tmp_path: Path) -> None:
    """The queue is the dataset's, not the run's: a worker that follows it for a run whose producer
    was killed (the queue still active) is checked again when the run is resumed naming a path where
    it sees other files, and the resumed run loses no prompt to it."""
    same, tok, other = tmp_path / "same", tmp_path / "tok", tmp_path / "other"
    for folder in (same, tok, other):
        shutil.copytree(DEMO_TOKENIZER, folder)
    _other_template(other)
    fleet.start_simulator("--latency-median-ms", "300")
    stranger = _worker_in_namespace(fleet, "stranger", 'mount --bind "$1" "$2"', [str(other), str(tok)],
                                    SPECFLEET_TOKENIZER_FROM="local")
    fleet.wait_ready("stranger")
    # Its files: the stranger follows the queue. A window of 20 leaves most prompts to the resumed run.
    fleet.start_producer(_config(fleet, same, n=KILLED_RUN_PROMPTS), env={"SPECFLEET_QUEUE_WINDOW_PROMPTS": "20"})
    fleet.wait_for(lambda: "settle: kept" in fleet.log("stranger"), 60, "the stranger's first row")
    fleet.signal("producer", signal.SIGKILL)

    fleet.start_worker("w1", concurrency=10)
    fleet.wait_ready("w1")
    fleet.run_producer(_config(fleet, tok, n=KILLED_RUN_PROMPTS), timeout_s=150, name="resumed")
    fleet.wait_for(lambda: stranger.poll() is not None, 30, "the refusing worker to leave")
    _one_refusal(fleet, "stranger", tok, other)
    assert "resuming with" in fleet.log("resumed")
    # What the stranger took went straight back to the queue: no prompt waited for the producer's sweep.
    assert "lacking an outcome" not in fleet.log("resumed")
    assert fleet.log("w1").count("settle: kept") >= KILLED_RUN_PROMPTS // 2  # the resumed run's: w1's
    _assert_rows_are_the_manifests(fleet, n=KILLED_RUN_PROMPTS)
    assert read_summary(fleet.out, "T")["failed"] == 0


@pytest.mark.fleet
@needs_namespaces
@pytest.mark.timeout(300)
def test_a_worker_where_the_producers_tokenizer_path_does_not_exist_makes_the_runs_rows_from_redis(
        fleet: Fleet, redis_client: redis.Redis, tmp_path: Path) -> None:
    hidden = tmp_path / "producer-host"
    tok = hidden / "tok"
    shutil.copytree(DEMO_TOKENIZER, tok)
    cache = tmp_path / "cache"
    fleet.start_simulator("--latency-median-ms", "20")
    config = _config(fleet, tok)
    # An empty file system over the producer's folder: the path does not exist on this "host".
    fleet_worker = _worker_in_namespace(fleet, "elsewhere", 'mount -t tmpfs none "$1" && test ! -e "$2"',
                                        [str(hidden), str(tok)], SPECFLEET_TOKENIZER_CACHE_DIR=str(cache))
    fleet.wait_ready("elsewhere")
    producer = fleet.start_producer(config)
    fleet.wait_for(lambda: producer.poll() is not None or fleet_worker.poll() is not None, 150, "the run")
    assert fleet_worker.poll() is None, fleet.log("elsewhere")  # it did not refuse the run
    fleet.wait_for(lambda: producer.poll() is not None, 30, "the producer's exit")
    assert producer.returncode == 0, fleet.all_logs()
    manifest = read_manifest(fleet.out)
    handoff = handoff_id(manifest.tokenizer.files)
    assert f"from {cache / handoff}" in fleet.log("elsewhere")
    assert 0 < redis_client.ttl(keys.tokenizer_files(handoff)) <= HANDOFF_TTL_S
    _assert_rows_are_the_manifests(fleet)


def test_the_cache_is_written_from_redis_checked_and_rewritten_when_damaged(
        redis_client: redis.Redis, tmp_path: Path) -> None:
    """``fetch`` without a fleet: the files from Redis into ``cache/<handoff>``, a damaged copy
    replaced, an expired key None; ``check`` names a missing file."""
    files = {p.name: _sha(p) for p in DEMO_TOKENIZER.iterdir()}
    config = json.loads((DEMO_TOKENIZER / "tokenizer_config.json").read_text())
    pin = TokenizerPin(files=files, chat_template_sha256=hashlib.sha256(config["chat_template"].encode()).hexdigest(),
                       handoff=handoff_id(files) + "test")
    key = keys.tokenizer_files(pin.handoff or "")
    redis_client.delete(key)
    assert fetch(redis_client, pin, tmp_path) is None
    redis_client.hset(key, mapping={name: (DEMO_TOKENIZER / name).read_bytes() for name in files})
    try:
        folder = fetch(redis_client, pin, tmp_path)
        assert folder == tmp_path / (pin.handoff or "") and {p.name: _sha(p) for p in folder.iterdir()} == files
        assert folder.stat().st_mode & 0o777 == 0o755  # every user's workers on the host read it
        (folder / "tokenizer.json").write_text("{}")
        assert fetch(redis_client, pin, tmp_path) == folder
        assert _sha(folder / "tokenizer.json") == files["tokenizer.json"]
        (folder / "tokenizer.json").unlink()
        missing = r"tokenizer file tokenizer.json in .* here absent, manifest [0-9a-f]{12}$"
        with pytest.raises(TokenizerError, match=missing):
            check(folder, pin)
    finally:
        redis_client.delete(key)


def _fetch_and_check_in_a_loop(redis_url: str, pin_json: str, cache: str, rounds: int) -> str:
    """One process of a host (or container on a shared cache): fetch, then read the folder, as a
    worker does before it loads it. Returns the first refusal's line, else ''."""
    client = redis.Redis.from_url(redis_url)
    pin = TokenizerPin.model_validate_json(pin_json)
    for _ in range(rounds):
        try:
            folder = fetch(client, pin, Path(cache))
            assert folder is not None
            check(folder, pin)
        except TokenizerError as exc:
            return str(exc)
    return ""


def test_processes_fetching_into_one_cache_at_once_never_see_each_others_folder_half_gone(
        redis_client: redis.Redis, redis_server: Any, tmp_path: Path) -> None:
    """Two compose replicas on one cache once refused a run ("tokenizer_config.json … here absent"):
    a fetch that lost the race removed the winner's folder while the winner checked it. Eight
    processes fetch into one empty cache at once, 40 times; none may see the folder go missing."""
    import multiprocessing

    files = {p.name: _sha(p) for p in DEMO_TOKENIZER.iterdir()}
    config = json.loads((DEMO_TOKENIZER / "tokenizer_config.json").read_text())
    pin = TokenizerPin(files=files, chat_template_sha256=hashlib.sha256(config["chat_template"].encode()).hexdigest(),
                       handoff=handoff_id(files) + "race")
    key = keys.tokenizer_files(pin.handoff or "")
    redis_client.hset(key, mapping={name: (DEMO_TOKENIZER / name).read_bytes() for name in files})
    url = redis_server.connection_url
    try:
        with multiprocessing.get_context("spawn").Pool(8) as pool:
            for attempt in range(40):  # each from an empty cache: every process races to write it
                cache = tmp_path / f"cache{attempt}"
                refusals = pool.starmap(_fetch_and_check_in_a_loop, [(url, pin.model_dump_json(), str(cache), 3)] * 8)
                assert refusals == [""] * 8, (attempt, refusals)
                assert [p.name for p in cache.iterdir()] == [pin.handoff]  # no staging or damaged folder left
    finally:
        redis_client.delete(key)
