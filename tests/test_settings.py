"""``Settings.from_env``: every default once, every bad value named by its variable.

The defaults a bare environment gives are the dataclass's own (one place to read them), each
variable parses to its field, and each kind of bad value is refused with the same words.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from common.errors import ConfigError
from common.settings import OPENROUTER_DEFAULT_BASE_URL, Settings


def test_an_empty_environment_gives_the_declared_defaults() -> None:
    s = Settings.from_env({})
    assert s == Settings(redis_url=None, openrouter_api_key=None)
    assert (s.openrouter_base_url, s.worker_concurrency, s.visibility_timeout_s, s.queue_poll_s) == (
        OPENROUTER_DEFAULT_BASE_URL, 1000, 7200, 2.0)
    assert (s.unacked_restore_s, s.redis_retry_window_s, s.metrics_port, s.log_level) == (5.0, 300.0, 9808, "INFO")
    assert s.spool_dir == Path.home() / ".cache" / "specfleet" / "spool"
    assert (s.max_answer_bytes, s.answer_bytes_in_flight) == (8 << 20, 4 << 20)
    assert (s.engine_url, s.engine_api_key, s.app_title) == (None, None, "specfleet")
    # An empty value is no value: the default (compose passes unset variables as "").
    blank = {name: "" for name in _VARIABLES}
    assert Settings.from_env(blank) == s


_VARIABLES = {
    "REDIS_URL": ("redis_url", "redis://h:1/2", "redis://h:1/2"),
    "OPENROUTER_API_KEY": ("openrouter_api_key", "sk-or-v1-x", "sk-or-v1-x"),
    "OPENROUTER_BASE_URL": ("openrouter_base_url", "http://sim:8765/", "http://sim:8765"),
    "SPECFLEET_CONCURRENCY": ("worker_concurrency", "12", 12),
    "SPECFLEET_VISIBILITY_TIMEOUT_S": ("visibility_timeout_s", "60", 60),
    "SPECFLEET_QUEUE_POLL_S": ("queue_poll_s", "0.5", 0.5),
    "SPECFLEET_UNACKED_RESTORE_S": ("unacked_restore_s", "1.5", 1.5),
    "SPECFLEET_REDIS_RETRY_WINDOW_S": ("redis_retry_window_s", "0", 0.0),
    "SPECFLEET_SPOOL_DIR": ("spool_dir", "~/spool", Path.home() / "spool"),
    "SPECFLEET_METRICS_PORT": ("metrics_port", "9000", 9000),
    "SPECFLEET_LOG_LEVEL": ("log_level", "debug", "DEBUG"),
    "SPECFLEET_APP_URL": ("app_url", "https://example.org", "https://example.org"),
    "SPECFLEET_APP_TITLE": ("app_title", "mine", "mine"),
    "SPECFLEET_ENGINE_URL": ("engine_url", "http://vllm:8000/v1/", "http://vllm:8000/v1"),
    "SPECFLEET_ENGINE_API_KEY": ("engine_api_key", "k", "k"),
    "SPECFLEET_MAX_ANSWER_BYTES": ("max_answer_bytes", "2048", 2048),
    "SPECFLEET_ANSWER_BYTES_IN_FLIGHT": ("answer_bytes_in_flight", "4096", 4096),
    "SPECFLEET_QUEUE_WINDOW_PROMPTS": ("queue_window_prompts", "500", 500),
    "SPECFLEET_QUEUE_WINDOW_BYTES": ("queue_window_bytes", "1048576", 1 << 20),
    "SPECFLEET_BATCH_SUBMIT_TIMEOUT_S": ("batch_submit_timeout_s", "30", 30.0),
    "SPECFLEET_TOKENIZER_FROM": ("tokenizer_from", "local", "local"),
    "SPECFLEET_TOKENIZER_CACHE_DIR": ("tokenizer_cache_dir", "~/tok", Path.home() / "tok"),
}


def test_every_variable_sets_its_field() -> None:
    s = Settings.from_env({name: raw for name, (_, raw, _) in _VARIABLES.items()})
    assert {f: getattr(s, f) for f, _, _ in _VARIABLES.values()} == {f: v for f, _, v in _VARIABLES.values()}
    assert {f.name for f in dataclasses.fields(Settings)} == {f for f, _, _ in _VARIABLES.values()}


@pytest.mark.parametrize(("env", "message"), [
    ({"SPECFLEET_CONCURRENCY": "lots"}, "environment variable SPECFLEET_CONCURRENCY='lots': not a whole number"),
    ({"SPECFLEET_CONCURRENCY": "0"}, "environment variable SPECFLEET_CONCURRENCY='0': must be >= 1"),
    ({"SPECFLEET_VISIBILITY_TIMEOUT_S": "5"}, "environment variable SPECFLEET_VISIBILITY_TIMEOUT_S='5': must be >= 10"),
    ({"SPECFLEET_METRICS_PORT": "99999"}, "environment variable SPECFLEET_METRICS_PORT='99999': must be <= 65535"),
    ({"SPECFLEET_QUEUE_POLL_S": "soon"}, "environment variable SPECFLEET_QUEUE_POLL_S='soon': not a number"),
    ({"SPECFLEET_QUEUE_POLL_S": "0.01"}, "environment variable SPECFLEET_QUEUE_POLL_S='0.01': must be >= 0.1"),
    ({"SPECFLEET_REDIS_RETRY_WINDOW_S": "-1"},
     "environment variable SPECFLEET_REDIS_RETRY_WINDOW_S='-1': must be >= 0.0"),
    ({"SPECFLEET_MAX_ANSWER_BYTES": "10"}, "environment variable SPECFLEET_MAX_ANSWER_BYTES='10': must be >= 1024"),
    ({"OPENROUTER_BASE_URL": "openrouter.ai"},
     "environment variable OPENROUTER_BASE_URL='openrouter.ai': not an http(s) URL"),
    ({"SPECFLEET_ENGINE_URL": "vllm:8000"},
     "environment variable SPECFLEET_ENGINE_URL='vllm:8000': not an http(s) URL"),
    ({"SPECFLEET_LOG_LEVEL": "loud"}, "environment variable SPECFLEET_LOG_LEVEL='LOUD': not a log level"),
])
def test_a_bad_value_is_refused_naming_its_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(env)
    assert str(refused.value) == message


def test_a_bad_redis_url_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^environment variable REDIS_URL"):
        Settings.from_env({"REDIS_URL": "localhost:6379"})


def test_secrets_stay_out_of_the_repr() -> None:
    s = Settings.from_env({"OPENROUTER_API_KEY": "sk-or-v1-secret", "SPECFLEET_ENGINE_API_KEY": "engine-secret"})
    assert "secret" not in repr(s)
