"""The run's Redis memory estimate (producer/redis_memory.py) against a real server's maxmemory."""

from __future__ import annotations

from pathlib import Path

import redis

from common.config import RunConfig
from producer import redis_memory
from producer.window import WindowBounds
from tests.fleet import DEMO_TOKENIZER, prompts, write_jsonl


def _config(tmp_path: Path, n: int) -> RunConfig:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(n, "d"))
    return RunConfig.model_validate({
        "model": {"name": "m", "tokenizer": str(DEMO_TOKENIZER)},
        "datasets": [{"name": "D", "path": str(data), "budget_tokens": 1_000_000}],
    })


def test_the_estimate_is_the_window_not_the_file_and_warns_under_maxmemory(tmp_path: Path,
                                                                           redis_client: redis.Redis) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "l").mkdir()
    small, large = _config(tmp_path / "s", 1_000), _config(tmp_path / "l", 20_000)
    window = WindowBounds(prompts=500, bytes=64 << 20)
    need_small = redis_memory.estimate(small, window, [(1_000, (tmp_path / "s" / "d.jsonl").stat().st_size)])
    need_large = redis_memory.estimate(large, window, [(20_000, (tmp_path / "l" / "d.jsonl").stat().st_size)])
    # Twenty times the prompts, the same window and rows to the budget: the same memory.
    assert abs(need_small.window_bytes - need_large.window_bytes) < need_small.window_bytes / 100
    assert abs(need_large.total - need_small.total) < 1 << 20

    previous = redis_client.config_get("maxmemory")["maxmemory"]
    try:
        redis_client.config_set("maxmemory", str(4 << 20))
        too_small, line = redis_memory.check(redis_client, large, window)
        assert too_small and "over maxmemory 4 MiB" in line, line
        redis_client.config_set("maxmemory", str(1 << 30))
        too_small, line = redis_memory.check(redis_client, large, window)
        assert not too_small and "within maxmemory" in line, line
    finally:
        redis_client.config_set("maxmemory", previous)
    assert redis_memory.verdict(need_large, None, refused=True)[1].endswith("maxmemory unknown (CONFIG GET refused)")
