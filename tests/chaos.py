"""Breaking things on purpose lives in ``harness/chaos.py`` (shared with bench/soak.py); the tests' old
import path."""

from harness.chaos import AOF_CONFIG, RestartableValkey, poison_messages, read_shards

__all__ = ["AOF_CONFIG", "RestartableValkey", "poison_messages", "read_shards"]
