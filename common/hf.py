"""The one door to Hugging Face ``transformers``: imported late (it is slow) and quietly.

specfleet needs tokenizers only. Without PyTorch, importing transformers prints an advisory that
"models won't be available" on every start, which reads like a fault in a producer's one-line
errors and in every worker's log.
"""

from __future__ import annotations

import os
from typing import Any


def auto_tokenizer() -> Any:
    """``transformers.AutoTokenizer``."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer
