"""Every upstream URL, derived once from the base URL as a user writes it.

``OPENROUTER_BASE_URL`` (and ``SPECFLEET_ENGINE_URL``) may be any of the forms people copy: OpenRouter's
docs and the OpenAI SDK give ``https://openrouter.ai/api/v1``, the site is ``https://openrouter.ai``,
every OpenAI-compatible server (vLLM, SGLang, llama.cpp, LiteLLM) is ``http://host:port/v1``, and some
paste the full chat URL. The rule, applied to the URL's path (a trailing ``/`` ignored):

1. a path ending in ``/chat/completions`` has it stripped (the full chat URL);
2. a path then ending in ``/v1`` (``/api/v1``, ``/v1``, ``/inference/v1``) is the API root;
3. a bare host (no path) gets its layout's root: ``/api/v1`` (OpenRouter's) for ``OPENROUTER_BASE_URL``,
   ``/v1`` (vLLM's, SGLang's) for an engine;
4. any other path is the API root as written (the OpenAI SDK's rule: routes are appended to it).

Every route is the root plus its OpenRouter path (``chat/completions``, ``models``, ``key``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

#: The API root under a bare host: OpenRouter's layout, and an OpenAI-compatible engine's.
OPENROUTER_ROOT = "/api/v1"
ENGINE_ROOT = "/v1"
CHAT_SUFFIX = "/chat/completions"
#: Said wherever a base URL led nowhere (a 404 on the first requests).
ACCEPTED_FORMS = ("https://openrouter.ai/api/v1, https://openrouter.ai, http://host:port/v1, http://host:port "
                  "or a full .../v1/chat/completions")


@dataclass(frozen=True)
class Endpoints:
    """The routes of one upstream; ``root`` is its API root (``https://openrouter.ai/api/v1``)."""

    root: str

    @classmethod
    def of(cls, base_url: str, *, bare_root: str = OPENROUTER_ROOT) -> Endpoints:
        """The routes under ``base_url`` (the module's rule). ``ValueError`` names what is wrong with it."""
        parts = urlsplit(base_url.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{base_url!r} is not an http(s) URL with a host")
        if parts.query or parts.fragment:
            raise ValueError(f"{base_url!r}: a base URL takes no query or fragment")
        path = parts.path.rstrip("/").removesuffix(CHAT_SUFFIX).rstrip("/")
        if not path:
            path = bare_root
        return cls(f"{parts.scheme}://{parts.netloc}{path}")

    @property
    def chat(self) -> str:
        return self.root + CHAT_SUFFIX

    @property
    def models(self) -> str:
        return self.root + "/models"

    def model_endpoints(self, model_id: str) -> str:
        """``models/{author}/{slug}/endpoints`` of a model id (a ``:variant`` suffix dropped)."""
        return f"{self.models}/{model_id.split(':', 1)[0]}/endpoints"

    @property
    def key(self) -> str:
        return self.root + "/key"

    @property
    def credits(self) -> str:
        return self.root + "/credits"

    @property
    def generation(self) -> str:
        return self.root + "/generation"

    @property
    def batches(self) -> str:
        return self.root + "/batches"

    @property
    def llama_tokenize(self) -> str:
        """llama.cpp's ``llama-server`` ``/tokenize``: at the server's root, beside its ``/v1`` routes."""
        return self.root.removesuffix(ENGINE_ROOT) + "/tokenize"


__all__ = ["ACCEPTED_FORMS", "CHAT_SUFFIX", "ENGINE_ROOT", "OPENROUTER_ROOT", "Endpoints"]
