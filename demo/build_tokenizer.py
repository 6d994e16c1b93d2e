"""Write the demo tokenizer (Kimi-K2.5-like) into ``demo/tokenizer/``: from the repo's root,
``python -m demo.build_tokenizer``.

The files are committed so the demo runs offline; this script only rebuilds them. The builder is the
one the tests use (``harness/tokenizer_factory.py``), so the demo and the tests share one definition.
"""

from __future__ import annotations

from pathlib import Path

from harness.tokenizer_factory import KIMI_K25, write_tokenizer

REPO = Path(__file__).resolve().parents[1]

DEMO_TOKENIZER_DIR = REPO / "demo" / "tokenizer"


def main() -> None:
    print(write_tokenizer(KIMI_K25, DEMO_TOKENIZER_DIR))


if __name__ == "__main__":
    main()
