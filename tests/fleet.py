"""The fleet launcher lives in ``harness/fleet.py`` (shared with bench/); the tests' old import path."""

from harness.fleet import (
    DEMO_TOKENIZER,
    REPO,
    TEST_KEY,
    Fleet,
    free_port,
    prompts,
    read_rows,
    read_summary,
    write_jsonl,
)

__all__ = ["DEMO_TOKENIZER", "REPO", "TEST_KEY", "Fleet", "free_port", "prompts", "read_rows", "read_summary",
           "write_jsonl"]
