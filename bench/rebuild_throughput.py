"""Tokens/s of ``rebuild`` on a ~32k-token answer (reasoning + content + tool calls), demo tokenizer.

Prints the time of one call (the CPU work a worker hands to ``gevent.get_hub().threadpool``) and the
longest gap a ticking greenlet saw while that call ran in the threadpool: what the hub would stall.

    python -m bench.rebuild_throughput [--tokens 32000] [--runs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import gevent

from common.rebuild import RebuiltRow, rebuild
from common.target import TargetTokenizer
from workers.upstreams.upstream import Answer

REPO = Path(__file__).resolve().parents[1]

# Words of English prose, code/JSON and other scripts; one sentence-sized stream of them.
_PHRASES = (
    "the model should first check the weather then compare it with yesterday and answer briefly",
    'def run(argv): return main(argv[1:]) {"city": "Paris", "days": 3} 42 3.14159',
    "我们 一步一步 思考 Привет мир ça déjà 🙂 🚀 — …",
)
_WORDS = [word for phrase in _PHRASES for word in phrase.split(" ")] + ["\n"]


def _text(rng: random.Random, target: TargetTokenizer, tokens: int) -> str:
    words: list[str] = []
    text = ""
    while len(target.encode(text)) < tokens:
        words += rng.choices(_WORDS, k=50)
        text = " ".join(words)
    return text


def _answer(target: TargetTokenizer, tokens: int) -> Answer:
    rng = random.Random(7)
    calls = [
        {"id": f"functions.search:{i}", "type": "function",
         "function": {"name": "search", "arguments": '{"query": "' + _text(rng, target, 200) + '"}'}}
        for i in range(3)
    ]
    return Answer(
        reasoning=_text(rng, target, tokens * 2 // 3),
        content=_text(rng, target, tokens // 3 - 800),
        tool_calls=calls,
        finish_reason="tool_calls",
    )


def _hub_stall_ms(target: TargetTokenizer, messages: list[dict[str, str]], answer: Answer) -> float:
    """Longest gap between 1 ms ticks of a greenlet while the rebuild runs in the hub's threadpool."""
    gaps: list[float] = []
    done = False

    def tick() -> None:
        last = time.perf_counter()
        while not done:
            gevent.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = gevent.spawn(tick)
    gevent.sleep(0.01)
    gevent.get_hub().threadpool.apply(rebuild, (target, messages, None, answer))
    done = True
    ticker.join()
    return max(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokenizer", default=str(REPO / "demo" / "tokenizer"))
    args = parser.parse_args()

    target = TargetTokenizer.load(args.tokenizer, trust_remote_code=False)
    messages = [{"role": "user", "content": "Plan a three-day trip to Paris and check the weather."}]
    answer = _answer(target, args.tokens)

    row: RebuiltRow | None = None
    times_s = []
    for _ in range(args.runs):
        started = time.perf_counter()
        row = rebuild(target, messages, None, answer)
        times_s.append(time.perf_counter() - started)
    assert row is not None
    one_s = statistics.median(times_s)
    chars = len(row.completion_text)
    print(f"tokenizer            {args.tokenizer}")
    print(f"completion           {row.completion_tokens} tokens, {chars} chars, reasoning_end={row.reasoning_end}")
    print(f"rebuild (one call)   {one_s * 1000:.1f} ms median of {args.runs} (min {min(times_s) * 1000:.1f} ms)")
    print(f"throughput           {row.completion_tokens / one_s:,.0f} tokens/s")
    print(f"hub stall            {_hub_stall_ms(target, messages, answer):.1f} ms longest tick gap, "
          "rebuild in gevent threadpool")


if __name__ == "__main__":
    main()
