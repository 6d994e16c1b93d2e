"""A self-hosted OpenAI-compatible engine as an ``Upstream``: vLLM, or SGLang, with the token ids.

The request is OpenRouter's chat body plus ``return_token_ids: true``; the answer is parsed and its
failures classified exactly as ``workers/upstreams/openrouter.py`` does (the statuses mean the same on an
OpenAI-compatible server: 401 a wrong ``--api-key``, 404 or "model … does not exist" a wrong
served model name, 5xx/timeouts retryable), plus the ids the engine sampled:

- **vLLM** (``return_token_ids``, vLLM ≥ 0.10.2): top-level ``prompt_token_ids`` (its chat template
  rendered with the generation prompt) and ``choices[0].token_ids`` (the completion, with the stop
  token it sampled). Reasoning comes as ``reasoning_content`` or, in later versions, ``reasoning``
  when the server runs a ``--reasoning-parser``.
- **SGLang** (non-streaming ``/v1/chat/completions``): ``return_token_ids`` gives
  ``choices[0].token_ids`` (its ``output_ids``) and ``return_prompt_token_ids`` gives
  ``choices[0].prompt_token_ids`` (sglang ``python/sglang/srt/entrypoints/openai/protocol.py``:
  ``ChatCompletionRequest.return_prompt_token_ids``/``return_token_ids``,
  ``ChatCompletionResponseChoice.prompt_token_ids``/``token_ids``), so both flags are sent. Builds
  patched to answer like vLLM put ``prompt_token_ids`` at the top level instead: the prompt ids are
  read from the choice first, then from the top level (vLLM: the other way round); stock SGLang
  before these fields returns no ids at all. Reasoning comes as ``reasoning_content``. SGLang may
  trim a matched stop token from ``output_ids`` (``no_stop_trim`` false); the row step puts the
  end-of-turn token back where the turn ended.

- **llama.cpp** (its C++ ``llama-server``; llama-cpp-python's Python server returns no ids): with
  ``return_tokens`` and ``verbose`` its ``/v1/chat/completions`` answer carries ``__verbose``, whose
  ``tokens`` are the completion ids it sampled (the end-of-generation token included) and whose
  ``prompt`` is the prompt it evaluated, as text (its ids detokenized, special tokens written out).
  The prompt ids are that text through the same server's ``/tokenize`` (special tokens parsed, none
  added): the ids it tokenized the rendered template into, since tokenizing is deterministic and the
  byte-level text round-trips exactly. One more request per answer, to the same server.

An engine that answers without ids (too old, or a proxy that drops unknown fields) is the run's
misconfiguration, not the prompt's: every answer would be alike, so it halts like a wrong model,
naming the engine and, at the end of its halt line, what to upgrade (``NO_IDS_FIX``, the error's
``fix``).
"""

from __future__ import annotations

from typing import Any, Literal

import requests

from common.endpoints import ENGINE_ROOT, Endpoints
from common.errors import MisconfiguredError, RetryableUpstreamError
from workers.upstreams.openrouter import OpenRouterClient, request_body
from workers.upstreams.upstream import Request

EngineKind = Literal["vllm", "sglang", "llamacpp"]
#: The body flags that ask each engine for its ids.
ID_FLAGS: dict[str, dict[str, bool]] = {
    "vllm": {"return_token_ids": True},
    "sglang": {"return_token_ids": True, "return_prompt_token_ids": True},
    "llamacpp": {"return_tokens": True, "verbose": True},
}
#: What to do when an engine answers without them: the version that has them, and the way around.
NO_IDS_FIX = {  # short: the halt message keeps 300 characters and always the whole fix (contract.halt_message)
    "vllm": "upgrade vLLM to >= 0.10.2 (return_token_ids), or bypass a proxy that drops fields",
    "sglang": "upgrade SGLang to one whose chat API takes return_prompt_token_ids, or bypass a proxy "
              "that drops fields",
    "llamacpp": "serve with llama.cpp's own llama-server (llama-cpp-python's server returns no ids), or bypass "
                "a proxy that drops fields",
}
#: llama-server's ``/tokenize`` answers in milliseconds; a server that takes longer is failing.
TOKENIZE_TIMEOUT_S = 30.0


def _ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise RetryableUpstreamError("bad_token_ids", "token ids that are not a list of integers", status=200)
    return value


class EngineClient(OpenRouterClient):
    """One per worker process. ``kind`` says where the prompt ids are (vLLM: top level, SGLang:
    in the choice) and names the upstream in rows (``provider``) and halt messages."""

    #: ``http://host:8000`` means vLLM's and SGLang's ``/v1`` (``common/endpoints.py``).
    BARE_ROOT = ENGINE_ROOT

    def __init__(self, kind: EngineKind, base_url: str, api_key: str | None, *, pool_size: int) -> None:
        super().__init__(base_url, api_key or "", pool_size=pool_size, app_url="", app_title="")
        self.kind = kind
        for header in ("HTTP-Referer", "X-Title", "X-OpenRouter-Title"):
            self._session.headers.pop(header, None)
        if not api_key:  # a server started without --api-key takes requests without one
            self._session.headers.pop("Authorization", None)
        self.tokenize_url = Endpoints.of(base_url, bare_root=self.BARE_ROOT).llama_tokenize

    def _body(self, request: Request) -> dict[str, Any]:
        return {**request_body(request), **ID_FLAGS[self.kind]}

    def _extra_fields(self, body: dict[str, Any], choice: dict[str, Any], model: str) -> dict[str, Any]:
        if self.kind == "llamacpp":
            return self._llama_fields(body, model)
        # vLLM puts the prompt ids beside the choices, SGLang inside the choice (a patched SGLang
        # beside them): each kind's own place first, then the other.
        places = (body, choice) if self.kind == "vllm" else (choice, body)
        prompt = _ids(next((p["prompt_token_ids"] for p in places if p.get("prompt_token_ids") is not None), None))
        completion = _ids(choice.get("token_ids"))
        if prompt is None or completion is None:
            missing = " and ".join(n for n, v in (("prompt ids", prompt), ("completion ids", completion)) if v is None)
            raise MisconfiguredError(
                "no_token_ids",
                f"the {self.kind} server answered without {missing}",
                target=f"{self.url} with model {model!r}",
                status=200,
                fix=NO_IDS_FIX[self.kind],
            )
        return {"prompt_ids": prompt, "completion_ids": completion, "provider": body.get("provider") or self.kind}

    def _llama_fields(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        verbose = body.get("__verbose")
        verbose = verbose if isinstance(verbose, dict) else {}
        completion = _ids(verbose.get("tokens") or None)
        prompt_text = verbose.get("prompt")
        if completion is None or not isinstance(prompt_text, str) or not prompt_text:
            missing = " and ".join(n for n, v in (("completion ids", completion), ("its prompt", prompt_text)) if not v)
            raise MisconfiguredError("no_token_ids", f"the llamacpp server answered without {missing}",
                                     target=f"{self.url} with model {model!r}", status=200, fix=NO_IDS_FIX[self.kind])
        return {"prompt_ids": self._tokenize(prompt_text), "completion_ids": completion,
                "provider": body.get("provider") or self.kind}

    def _tokenize(self, text: str) -> list[int]:
        """``text``'s ids from the server's own tokenizer, special tokens parsed as the chat route does."""
        try:
            resp = self._session.post(self.tokenize_url, json={"content": text, "add_special": False,
                                                               "parse_special": True},
                                      timeout=TOKENIZE_TIMEOUT_S, allow_redirects=False)
        except requests.RequestException as exc:
            raise RetryableUpstreamError("tokenize", f"{self.tokenize_url}: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise RetryableUpstreamError("tokenize", f"{self.tokenize_url} answered {resp.status_code}",
                                         status=resp.status_code)
        try:
            tokens = resp.json().get("tokens")
        except ValueError:
            tokens = None
        ids = _ids(tokens)
        if not ids:
            raise RetryableUpstreamError("tokenize", f"{self.tokenize_url} answered without tokens", status=200)
        return ids


__all__ = ["ID_FLAGS", "NO_IDS_FIX", "TOKENIZE_TIMEOUT_S", "EngineClient", "EngineKind"]
