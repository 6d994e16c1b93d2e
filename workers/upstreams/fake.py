"""An in-process ``Upstream`` for tests, in the manner of httpx's ``MockTransport``: a handler
function answers each ``Request`` (or raises one of the typed errors), and every request is kept.

    fake = FakeUpstream(lambda req: text_answer("hello"))
    ctx = WorkerContext(settings, upstream=fake)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from common.contract import Usage
from workers.upstreams.upstream import Answer, Request

Handler = Callable[[Request], Answer]


def text_answer(content: str, *, reasoning: str | None = None, finish_reason: str = "stop",
                completion_tokens: int = 10, prompt_tokens: int = 10, cost: float = 0.0) -> Answer:
    """An answer with the given parts, billed as the arguments say."""
    usage: Usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "reasoning_tokens": 0, "cost": cost}
    return Answer(reasoning=reasoning, content=content, tool_calls=None, finish_reason=finish_reason,
                  usage=usage, provider="fake", model="fake-model", generation_id="gen-fake")


class FakeUpstream:
    where = "fake://upstream"

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def complete(self, request: Request) -> Answer:
        with self._lock:
            self.requests.append(request)
        return self.handler(request)


__all__ = ["FakeUpstream", "text_answer"]
