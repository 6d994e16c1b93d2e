"""The conversation datasets live in ``harness/conversations.py`` (shared with
bench/conversations_run.py); the tests' old import path."""

from harness.conversations import billed_twice, check_rows, conversations

__all__ = ["billed_twice", "check_rows", "conversations"]
