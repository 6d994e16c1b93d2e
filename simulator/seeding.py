"""Deterministic identity of a request: the prompt hash and the RNGs derived from it.

Hashes go through SHA-256, never Python's ``hash()``, so they agree across processes and runs.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any


def prompt_hash(messages: Any) -> str:
    """Stable hash of the request messages (canonical JSON)."""
    canonical = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


def rng_for(seed: int, prompt: str, purpose: str, attempt: int = 0) -> random.Random:
    """An RNG for one purpose of one prompt: ``answer`` draws ignore the attempt so a retry gets
    the same answer; ``attempt`` draws (faults, latency, provider) differ per attempt."""
    digest = hashlib.sha256(f"{seed}:{prompt}:{purpose}:{attempt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))
