"""Who answers a prompt: the ``Upstream`` protocol and its implementations.

| module     | what                                                                          |
|------------|-------------------------------------------------------------------------------|
| upstream   | ``Upstream``: a ``Request`` in, an ``Answer`` out, or one of the typed errors |
| openrouter | OpenRouter: one chat-completions attempt, every reply classified              |
| vllm       | a self-hosted vLLM/SGLang engine, with the token ids it sampled               |
| fake       | in-process, for tests (httpx's ``MockTransport`` is the model)                |
"""
