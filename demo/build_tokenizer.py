"""Write the demo tokenizer (Kimi-K2.5-like) into ``demo/tokenizer/``: ``python demo/build_tokenizer.py``.

The files are committed so the demo runs offline; this script only rebuilds them. The builder is the
one the tests use (``tests/tokenizer_factory.py``), so the demo and the tests share one definition.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tokenizer_factory import KIMI_K25, write_tokenizer  # noqa: E402  (needs the repo on sys.path)

DEMO_TOKENIZER_DIR = REPO / "demo" / "tokenizer"


def main() -> None:
    print(write_tokenizer(KIMI_K25, DEMO_TOKENIZER_DIR))


if __name__ == "__main__":
    main()
