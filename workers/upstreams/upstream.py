"""What a worker asks a model and what it gets back, whoever serves it.

``Upstream`` has one method: a ``Request`` in, an ``Answer`` out, or one of the typed
``common.errors.UpstreamError`` classes raised (retryable, fatal for the prompt, refused account,
misconfiguration). One call is one attempt: retrying, halting and accounting are the caller's
(``workers/pipeline/retry.py``, ``workers/pipeline/job.py``), so a second upstream (a vLLM server that returns
token ids, say) is one new module implementing ``complete`` and nothing else.

Implementations: ``workers/upstreams/openrouter.py`` (HTTP) and ``workers/upstreams/fake.py`` (in-process,
for tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from common.contract import Usage


def no_usage() -> Usage:
    return {"prompt_tokens": 0, "completion_tokens": 0, "reasoning_tokens": 0, "cost": 0.0}


@dataclass(frozen=True)
class Request:
    """One generation, independent of any wire format."""

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    #: The run's ``[request]`` keys (temperature, reasoning, provider routing …), passed through.
    params: dict[str, Any]
    #: Wall-clock limit of this one attempt: connect, headers and the whole body.
    timeout_s: float
    #: The prompt rendered with the target's template, as the prepare step counted it; an engine
    #: that takes token ids can send these instead of ``messages``. HTTP chat APIs ignore them.
    prompt_ids: list[int] | None = None
    #: The most bytes the answer's body may take (``SPECFLEET_MAX_ANSWER_BYTES``); None: no limit.
    max_answer_bytes: int | None = None


@dataclass(frozen=True)
class Answer:
    """The parsed assistant message of one successful attempt.

    ``None`` = absent, ``""`` = present and empty. ``usage`` is what was billed, normalised once
    (absent fields are 0). ``completion_ids`` is set only by an engine that reports the ids it
    generated; the rebuild then has the truth instead of re-tokenizing the text.
    """

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    usage: Usage = field(default_factory=no_usage)
    provider: str = ""
    model: str = ""
    generation_id: str = ""
    native_finish_reason: str | None = None
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None


class Upstream(Protocol):
    """Whatever answers a ``Request``. One per worker process, shared by every greenlet."""

    #: Where requests go (a URL, or a name for an in-process fake): named in halt messages.
    where: str

    def complete(self, request: Request) -> Answer:
        """One attempt. Raises ``common.errors.UpstreamError`` subclasses, nothing else on purpose."""
        ...


__all__ = ["Answer", "Request", "Upstream", "no_usage"]
