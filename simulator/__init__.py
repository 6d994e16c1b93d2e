"""A local OpenRouter simulator, faithful to ``shared/reference/openrouter.md``.

Run it: ``python -m simulator --host 127.0.0.1 --port 8765 [flags]`` (``--help`` lists every
setting), or in tests ``with start_in_thread(SimSettings(port=0, latency_median_ms=0)) as sim:`` and
point the client at ``sim.api_base``.

Routes
------
``POST /api/v1/chat/completions``  OpenAI-style; needs ``Authorization: Bearer <non-empty>`` (or
    exactly ``--expect-key``). Answers carry ``X-Generation-Id``. ``stream: true`` gives SSE.
``GET /api/v1/generation?id=gen-…``  404 for ``generation_delay_s`` after the request, then stats.
``GET /api/v1/key``  ``{data: {limit, limit_remaining, usage, …}}``.
``GET /api/v1/models``  ``{data: [{id, name, context_length, pricing: {prompt, completion, request,
    internal_reasoning, input_cache_read, …}, top_provider: {context_length, max_completion_tokens},
    supported_parameters, …}]}`` for each served model (``model`` plus ``models``); prices are USD
    per token as decimal strings, the very prices the chat route bills with
    (``price_in_per_mtok``, ``price_out_per_mtok``, ``price_request_usd``). No key needed.
``GET /api/v1/models/{author}/{slug}/endpoints``  ``{data: {id, name, endpoints: [{provider_name,
    pricing, context_length, max_completion_tokens, …}]}}``, one endpoint per provider; 404 for a
    model not served.
A chat request naming a model not served answers 404 ``No endpoints found for {model}.`` on every
attempt (not billed); prompt tokens + ``max_tokens`` above ``context_length`` answer 400 with
OpenRouter's "maximum context length" message. Any other path is a 404 (e.g. a doubled
``/api/v1/api/v1/…`` from a base URL given with ``/api/v1`` and a client that adds it again).
``POST /_sim/config``  partial settings update (JSON object, same names as the CLI flags;
    ``rates`` and ``length_classes`` merge by key); answers the full settings, 400 naming a bad
    field. ``GET /_sim/config`` shows them. Example: ``{"rates": {"429": 0.1, "hang": 0.02,
    "leak_im_end": 0.2}, "latency_median_ms": 0}``.
``GET /_sim/stats[?detail=1]``  the billing ledger (below). ``POST /_sim/reset``: counters,
    attempt counts and settings back to how the server started. ``GET /_sim/health``.

Answers
-------
Deterministic: text comes from RNGs seeded by ``seed`` and a SHA-256 of the request messages, so a
prompt gets the same answer in every process and on every retry (``engine.predict`` computes it
without a server). Lengths are drawn per length class (``length_classes``: the class with the
largest ``min_max_tokens`` not above the request's ``max_tokens``); ``max_tokens`` caps the
completion, and when reasoning alone reaches it, reasoning is cut, ``content`` is null and
``finish_reason`` is ``length``. ``reasoning: {exclude: true}`` bills but hides reasoning;
``{enabled: false}`` or ``effort: "none"`` turns it off. Tokens are counted by the rule in
``tokens.py`` or with ``--tokenizer``.

Faults (``rates`` keys, and ``fail_attempts`` entries): ``429`` ``502`` ``503`` ``408`` ``402``
(no Retry-After) ``402_retry`` (with) ``400`` ``401`` ``403`` ``hang`` (hold ``hang_s``, then
answer) ``hang_drop`` (hold, then close) ``bad_json`` (200, body cut in half) ``error200`` (200 with
an error object, null content, zero usage) ``stream_error`` (streams: an error chunk mid-way)
``trickle`` (the headers at once, then the reply, plain or streamed, one byte every
``trickle_every_s`` for ``trickle_s``, then the rest at once: a client's per-read timeout never
trips; the trickle stops at the first byte after the client left).
Their rates are one draw per attempt (sum <= 1), seeded by (seed, prompt, attempt number).
``leak_im_end`` in ``rates`` is independent of them: a share of answers whose content ends with
a leaked ``<|im_end|>``.

``#sim`` scripted answers
-------------------------
If the last user message's text starts with ``#sim `` followed by a JSON object (free text may
follow the object), the object steers the answer. Every key is optional; a key left out is
generated as usual:

- ``reasoning``: str | null (null: none). Scripted text is never cut by ``max_tokens``.
- ``content``: str | null; ``tool_calls``: ``[{"name", "arguments": obj|str, "id"?}]`` (or the
  OpenAI ``{"id", "type", "function": {…}}`` form); ids default to ``functions.<name>:<idx>``.
  Giving either one fixes the answer's shape (no random tool calls).
- ``raw_tool_text``: bool: put the tool calls as Kimi token text in ``content`` instead.
- ``finish_reason``: stop|length|tool_calls|content_filter|error; ``native_finish_reason``: str.
- ``reasoning_field``: "reasoning" | "reasoning_content" | "details" (only ``reasoning_details``).
- ``leak_im_end``: bool: content ends with a leaked ``<|im_end|>``.
- ``fail_attempts``: list of statuses / fault names, e.g. ``[429, 503, "hang", "bad_json",
  "error200"]``: the prompt's first attempts (counted per hash of the messages) meet these, then
  it is answered normally.
- ``latency_ms``: time to first token; ``retry_after_s``: Retry-After for this prompt's 429/503
  (null: none); ``provider``: provider name.
- ``noncanonical``: bool: with ``return_token_ids``, inject (or not) a non-canonical
  tokenization, whatever ``noncanonical_rate`` says.
- ``ids_shape``: vllm|sglang|none: with ``return_token_ids``, where the (non-streamed) answer
  puts the ids: ``vllm`` top-level ``prompt_token_ids`` + ``choices[0].token_ids`` (the default;
  SGLang builds patched to match vLLM too), ``sglang`` both in ``choices[0]``, ``none`` neither.
- ``usage``: overrides of ``prompt_tokens``, ``completion_tokens``, ``reasoning_tokens``,
  ``cached_tokens``, ``cost`` (cost is recomputed from the tokens unless given).
- ``usage_skew``: int: completion tokens billed beyond the answer's own, whatever
  ``usage_skew_rate`` says (0: none).

Usage counts: with ``--tokenizer DIR`` that has a chat template, a provider's engine's: the
template-rendered prompt's ids and the completion's ids (``<|im_end|>`` included when the turn
ended), as engine-ids mode gives them, so a client with the same tokenizer counts exactly the same.
The usage fault ``usage_skew_rate`` (seeded per prompt) bills ``usage_skew_tokens`` more completion
tokens on that share of answers, as a provider counting with another tokenizer would.

Example: ``#sim {"reasoning": "r", "content": "c", "fail_attempts": [429]} case-7``.

Capacity mode
-------------
``capacity_in_flight`` (N) and ``capacity_per_s`` (M), flags or ``/_sim/config``, null = off: a
valid chat request arriving while N admitted requests are in flight, or after M were admitted in
the last second, answers 429 ``Rate limit exceeded: {model}`` (``metadata.raw`` names the limit)
with ``Retry-After: capacity_retry_after_s`` (null: none), is not billed and is not an attempt of
its prompt. ``capacity_count_rejected``: refused requests count against M too. See
``capacity.py``; the in-flight series is ``series.py``.

Engine-ids mode (vLLM's ``return_token_ids``)
--------------------------------------------
A chat request with ``"return_token_ids": true`` (needs ``--tokenizer DIR`` with ``tokenizer.json``
and a chat template in ``tokenizer_config.json``; else 400) is answered as vLLM's OpenAI server
does: top-level ``"prompt_token_ids": [int]`` (the chat template rendered with the generation
prompt, tokenized without added BOS/EOS) and ``choices[0]["token_ids"]: [int]`` (the simulator's
own Kimi rendering of the turn, ``reasoning</think>content<tool section>``, ending with the
``<|im_end|>`` id when ``finish_reason`` is ``stop``/``tool_calls``, not on ``length``). Usage then
counts those ids. Streams carry ``prompt_token_ids`` on the first data chunk and every completion
id in ``token_ids`` of the chunk with the finish reason. ``noncanonical_rate`` (0..1, seeded per
prompt) or the ``#sim`` key ``noncanonical: true|false`` replaces one ordinary token by two
vocabulary tokens whose strings join to it: same text, non-canonical ids. Counted as
``noncanonical_answers``; ``?detail=1`` lists ``noncanonical_generations`` (generation ids) and each
generation's ``noncanonical: {position, canonical_id, ids, canonical_token, tokens}``. See
``engine_ids.py``. The first such request loads the chat template (transformers; ~1-2 s).

Stats JSON (``GET /_sim/stats``)
--------------------------------
``{"requests", "in_flight", "max_in_flight", "admitted_in_flight" (holding a capacity slot now),
"max_admitted_in_flight", "per_s_window" (admitted in the last second), "capacity_429s",
"capacity_429s_by_limit": {"in_flight": n, "per_second": n}, "scripted",
"by_status": {"200": n, "429": n, "dropped": n}, "faults": {name: n}, "finish_reasons": {…},
"billed_requests", "billed_prompt_tokens", "billed_completion_tokens", "billed_reasoning_tokens",
"billed_cached_tokens", "billed_cost_usd", "abandoned_requests", "abandoned_completion_tokens",
"engine_id_answers", "noncanonical_answers", "uptime_s"}``.

With ``?series=1[&since_s=T]`` also ``"series": {"interval_s", "columns": ["t_s", "in_flight",
"admitted_in_flight", "requests", "status_429", "capacity_429"], "rows": [[…]]}``: one row per
``series_interval_s`` bucket (the largest in-flight counts seen, arrivals and 429s in it; ``t_s``
on the ``uptime_s`` clock).

With ``?detail=1`` also ``"generations": [{"id", "prompt_hash", "fault", "finish_reason",
"streamed", "abandoned", "prompt_tokens", "completion_tokens", "reasoning_tokens", "cost",
"engine_ids", "noncanonical"}]`` and ``"noncanonical_generations": [id, …]``.

Billed: every generated answer (a non-streamed one in full even when its client timed out or
left: counted again under ``abandoned``; ``hang``, ``bad_json`` and a plain ``trickle``, abandoned
when its client left before the last byte, too); not billed: HTTP errors,
``hang_drop``, ``error200``.
"""

from simulator.engine import predict
from simulator.run import SimHandle, serve, start_in_thread
from simulator.settings import LengthDistribution, SettingsError, SimSettings

__all__ = [
    "LengthDistribution",
    "SettingsError",
    "SimHandle",
    "SimSettings",
    "predict",
    "serve",
    "start_in_thread",
]
