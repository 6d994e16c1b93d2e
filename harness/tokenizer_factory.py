"""Small HF tokenizers built on the spot (no download) that mimic the target models' turn formats.

The one builder for test tokenizers and for the demo tokenizer shipped in ``demo/tokenizer/``
(``demo/build_tokenizer.py`` calls ``write_tokenizer(KIMI_K25, …)``). Each is a byte-level BPE trained
on a small corpus (any Unicode encodes, via bytes), the family's special tokens as added tokens
above the trained vocabulary, and a chat template written after the family's real one:

* ``KIMI_K25``: Kimi K2.5 — the generation prompt ends ``<|im_assistant|>assistant<|im_middle|><think>``.
* ``KIMI_K2_THINKING``: Kimi K2-Thinking — the generation prompt stops at ``<|im_middle|>``.
* ``CHATML``: Qwen3-style ChatML — ``<|im_start|>``, ``<think>\\n…\\n</think>\\n\\n``, ``<tool_call>`` JSON,
  a simplified template that writes reasoning and content as given (strips nothing).
* ``QWEN3``: the same tokens with Qwen3's own template, which strips the newlines at the edges of
  reasoning and content and writes its own.
* ``DEEPSEEK``: DeepSeek-V3.1-style — ``<｜User｜>``, ``<｜Assistant｜><think>``, ``</think>``,
  ``<｜end▁of▁sentence｜>``, ``<｜tool▁calls▁begin｜>`` tool calls naming the function (no id).

Both Kimi templates keep the real ones' history/suffix split: every turn up to the last assistant
turn without tool calls is history, rendered with ``<think></think>`` (its reasoning dropped).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 2000

KIMI_SPECIALS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>",
    "<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]",
)
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen keeps these as added tokens that are not "special" (decode keeps them even when skipping).
CHATML_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

_KIMI_MACROS = r"""
{%- macro render_content(msg) -%}
  {%- set c = msg.get('content') -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is not none -%}
    {%- for part in c -%}
      {%- if part['type'] == 'text' -%}{{ part['text'] }}
      {%- else -%}<|media_start|>image<|media_content|><|media_pad|><|media_end|>
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro role_header(message) -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>
  {%- else -%}<|im_system|>{{ role_name }}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}
{%- macro render_toolcalls(message) -%}
  <|tool_calls_section_begin|>
  {%- for tool_call in message['tool_calls'] -%}
    <|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>
    {%- if tool_call['function']['arguments'] is string -%}{{ tool_call['function']['arguments'] }}
    {%- else -%}{{ tool_call['function']['arguments'] | tojson }}
    {%- endif -%}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}
{%- macro render_other(message) -%}
  {%- if message['role'] == 'tool' -%}{{ '## Return of ' ~ message.tool_call_id ~ '\n' }}{{ render_content(message) }}
  {%- elif message['content'] is not none -%}{{ render_content(message) }}
  {%- endif -%}
{%- endmacro -%}
{#- The last assistant turn without tool calls closes the history; reasoning survives only after it. -#}
{%- set ns = namespace(last_plain_assistant=-1) -%}
{%- for idx in range(messages|length - 1, -1, -1) -%}
  {%- if ns.last_plain_assistant == -1 and messages[idx]['role'] == 'assistant'
        and not messages[idx].get('tool_calls') -%}
    {%- set ns.last_plain_assistant = idx -%}
  {%- endif -%}
{%- endfor -%}
{%- set hist_msgs = messages[:ns.last_plain_assistant + 1] -%}
{%- set suffix_msgs = messages[ns.last_plain_assistant + 1:] -%}
"""

_KIMI_HEAD = r"""
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>
  {%- if tools_ts_str is defined -%}{{ tools_ts_str }}
  {%- else -%}{{ tools | tojson(separators=(',', ':')) }}
  {%- endif -%}
  <|im_end|>
{%- endif -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for message in hist_msgs -%}
  {{ role_header(message) }}
  {%- if message['role'] == 'assistant' -%}
    <think></think>{{ render_content(message) }}
    {%- if message.get('tool_calls') -%}{{ render_toolcalls(message) }}{%- endif -%}
  {%- else -%}{{ render_other(message) }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
"""

# K2.5 takes a ``thinking`` switch; thinking is on unless it is passed as false.
_K25_SUFFIX = r"""
{%- for message in suffix_msgs -%}
  {{ role_header(message) }}
  {%- if message['role'] == 'assistant' -%}
    {%- if thinking is defined and thinking is false -%}<think></think>
    {%- else -%}<think>{{ message.get('reasoning_content', '') }}</think>
    {%- endif -%}
    {{ render_content(message) }}
    {%- if message.get('tool_calls') -%}{{ render_toolcalls(message) }}{%- endif -%}
  {%- else -%}{{ render_other(message) }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
"""

_K2_THINKING_SUFFIX = r"""
{%- for message in suffix_msgs -%}
  {{ role_header(message) }}
  {%- if message['role'] == 'assistant' -%}
    <think>{{ message.get('reasoning_content', '') }}</think>{{ render_content(message) }}
    {%- if message.get('tool_calls') -%}{{ render_toolcalls(message) }}{%- endif -%}
  {%- else -%}{{ render_other(message) }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""

# Qwen3-style: reasoning only on assistant turns after the last user query; "\n" glue around the
# think block; Hermes ``<tool_call>`` JSON; "\n" after every ``<|im_end|>`` (never generated).
_CHATML_TEMPLATE = r"""
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments' -}}
  {{- ' within <tool_call></tool_call> XML tags.<|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_query -%}{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}
    {{- content -}}
    {%- for tool_call in message.tool_calls or [] -%}
      {%- if (loop.first and content) or not loop.first -%}{{- '\n' -}}{%- endif -%}
      {%- set f = tool_call.function if tool_call.function else tool_call -%}
      {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' -}}
      {%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\n<tool_response>\n' + (message.content or '') + '\n</tool_response><|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

# Qwen3's own chat template (hybrid thinking), verbatim: reasoning from ``reasoning_content`` or
# split out of ``content`` at ``</think>``, written as ``<think>\n{reasoning.strip('\n')}\n</think>\n\n``
# then ``content.lstrip('\n')`` on turns after the last user query; ``enable_thinking=False`` puts
# the empty block in the generation prompt.
_QWEN3_TEMPLATE = "\n".join([
    r'''{%- if tools %}''',
    r'''    {{- '<|im_start|>system\n' }}''',
    r'''    {%- if messages[0].role == 'system' %}''',
    r'''        {{- messages[0].content + '\n\n' }}''',
    r'''    {%- endif %}''',
    r'''    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou'''
    r''' are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}''',
    r'''    {%- for tool in tools %}''',
    r'''        {{- "\n" }}''',
    r'''        {{- tool | tojson }}''',
    r'''    {%- endfor %}''',
    r'''    {{- "\n</tools>\n\nFor each function call, return a json object with function name and'''
    r''' arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>,'''
    r''' \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}''',
    r'''{%- else %}''',
    r'''    {%- if messages[0].role == 'system' %}''',
    r'''        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}''',
    r'''    {%- endif %}''',
    r'''{%- endif %}''',
    r'''{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}''',
    r'''{%- for message in messages[::-1] %}''',
    r'''    {%- set index = (messages|length - 1) - loop.index0 %}''',
    r'''    {%- if ns.multi_step_tool and message.role == "user" and'''
    r''' not(message.content.startswith('<tool_response>') and'''
    r''' message.content.endswith('</tool_response>')) %}''',
    r'''        {%- set ns.multi_step_tool = false %}''',
    r'''        {%- set ns.last_query_index = index %}''',
    r'''    {%- endif %}''',
    r'''{%- endfor %}''',
    r'''{%- for message in messages %}''',
    r'''    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}''',
    r'''        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}''',
    r'''    {%- elif message.role == "assistant" %}''',
    r'''        {%- set content = message.content %}''',
    r'''        {%- set reasoning_content = '' %}''',
    r'''        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}''',
    r'''            {%- set reasoning_content = message.reasoning_content %}''',
    r'''        {%- else %}''',
    r'''            {%- if '</think>' in message.content %}''',
    r'''                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}''',
    r'''                {%- set reasoning_content ='''
    r''' message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}''',
    r'''            {%- endif %}''',
    r'''        {%- endif %}''',
    r'''        {%- if loop.index0 > ns.last_query_index %}''',
    r'''            {%- if loop.last or (not loop.last and reasoning_content) %}''',
    r'''                {{- '<|im_start|>' + message.role + '\n<think>\n' +'''
    r''' reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}''',
    r'''            {%- else %}''',
    r'''                {{- '<|im_start|>' + message.role + '\n' + content }}''',
    r'''            {%- endif %}''',
    r'''        {%- else %}''',
    r'''            {{- '<|im_start|>' + message.role + '\n' + content }}''',
    r'''        {%- endif %}''',
    r'''        {%- if message.tool_calls %}''',
    r'''            {%- for tool_call in message.tool_calls %}''',
    r'''                {%- if (loop.first and content) or (not loop.first) %}''',
    r'''                    {{- '\n' }}''',
    r'''                {%- endif %}''',
    r'''                {%- if tool_call.function %}''',
    r'''                    {%- set tool_call = tool_call.function %}''',
    r'''                {%- endif %}''',
    r'''                {{- '<tool_call>\n{"name": "' }}''',
    r'''                {{- tool_call.name }}''',
    r'''                {{- '", "arguments": ' }}''',
    r'''                {%- if tool_call.arguments is string %}''',
    r'''                    {{- tool_call.arguments }}''',
    r'''                {%- else %}''',
    r'''                    {{- tool_call.arguments | tojson }}''',
    r'''                {%- endif %}''',
    r'''                {{- '}\n</tool_call>' }}''',
    r'''            {%- endfor %}''',
    r'''        {%- endif %}''',
    r'''        {{- '<|im_end|>\n' }}''',
    r'''    {%- elif message.role == "tool" %}''',
    r'''        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}''',
    r'''            {{- '<|im_start|>user' }}''',
    r'''        {%- endif %}''',
    r'''        {{- '\n<tool_response>\n' }}''',
    r'''        {{- message.content }}''',
    r'''        {{- '\n</tool_response>' }}''',
    r'''        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}''',
    r'''            {{- '<|im_end|>\n' }}''',
    r'''        {%- endif %}''',
    r'''    {%- endif %}''',
    r'''{%- endfor %}''',
    r'''{%- if add_generation_prompt %}''',
    r'''    {{- '<|im_start|>assistant\n' }}''',
    r'''    {%- if enable_thinking is defined and enable_thinking is false %}''',
    r'''        {{- '<think>\n\n</think>\n\n' }}''',
    r'''    {%- endif %}''',
    r'''{%- endif %}''',
])

DEEPSEEK_SPECIALS = (
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜▁pad▁｜>",
)
DEEPSEEK_ADDED = ("<think>", "</think>")

# DeepSeek-V3.1-style, thinking on: BOS + system prompt, ``<｜User｜>…``, the generation prompt
# ``<｜Assistant｜><think>``, the model emits ``reasoning</think>content`` and tool calls as
# ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>…
# <｜tool▁calls▁end｜>``, then ``<｜end▁of▁sentence｜>`` (also the EOS). Turns before the last user
# message are history: ``</think>`` and the content after any ``</think>`` in it, reasoning dropped.
# Two departures from the real templates, which would leave nothing to rebuild against: they never
# render ``reasoning_content`` (so no template says where reasoning goes), and after a tool result
# they add no ``<｜Assistant｜>`` (the model's turn would start mid-sequence); here every assistant turn
# has its header and turns after the last user message keep their reasoning.
_DEEPSEEK_TEMPLATE = r"""
{%- if thinking is not defined -%}{%- set thinking = true -%}{%- endif -%}
{%- set ns = namespace(system_prompt='', is_first_sp=true, last_user=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}{%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
    {%- else -%}{%- set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] -%}
    {%- endif -%}
    {%- set ns.is_first_sp = false -%}
  {%- elif message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {%- set ns.system_prompt = ns.system_prompt + '\n\n## Tools\nYou have access to the following tools:\n' -%}
  {%- for tool in tools -%}
    {%- set ns.system_prompt = ns.system_prompt + '\n### ' + tool.function.name + '\nDescription: '
        + (tool.function.description or '') + '\n\nParameters: ' + (tool.function.parameters | tojson) + '\n' -%}
  {%- endfor -%}
{%- endif -%}
{{- bos_token }}{{ ns.system_prompt -}}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}{{- '<｜User｜>' + message['content'] -}}
  {%- elif message['role'] == 'assistant' -%}
    {%- set content = message['content'] if message['content'] is string else '' -%}
    {{- '<｜Assistant｜>' -}}
    {%- if thinking and loop.index0 > ns.last_user -%}
      {{- '<think>' + (message.get('reasoning_content') or '') + '</think>' -}}
    {%- else -%}
      {%- if '</think>' in content -%}{%- set content = content.split('</think>', 1)[1] -%}{%- endif -%}
      {{- '</think>' -}}
    {%- endif -%}
    {{- content -}}
    {%- if message.get('tool_calls') -%}
      {{- '<｜tool▁calls▁begin｜>' -}}
      {%- for tool in message['tool_calls'] -%}
        {%- set args = tool['function']['arguments'] -%}
        {{- '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'
            + (args if args is string else args | tojson) + '<｜tool▁call▁end｜>' -}}
      {%- endfor -%}
      {{- '<｜tool▁calls▁end｜>' -}}
    {%- endif -%}
    {{- '<｜end▁of▁sentence｜>' -}}
  {%- elif message['role'] == 'tool' -%}
    {{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' + ('<think>' if thinking else '</think>') -}}{%- endif -%}
"""

# Enough text for merges of everyday English, code, JSON and a few scripts; everything else falls
# back to single bytes, which is all the tests need (exact, just longer).
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Let me think about this step by step. "
    "First, we need to understand the question. The answer is 42 because six times seven is 42. "
    "I will call the weather tool to get the forecast for Paris, then summarise it for the user. "
    "def main(argv: list[str]) -> int:\n    return run(argv[1:])\n\nif __name__ == '__main__':\n    main()\n",
    '{"city": "Paris", "unit": "celsius", "days": 3, "query": "weather in Paris", "ok": true}',
    "functions.get_weather:0 functions.search:1 ## Return of functions.get_weather:0\n",
    "Bonjour, comment ça va ? Größe, Straße, naïve café, déjà vu. Привет, как дела? Спасибо.",
    "你好，世界。我们来一步一步地思考这个问题。今天天气很好。 こんにちは世界。 안녕하세요.",
    "مرحبا بالعالم. שלום עולם. नमस्ते दुनिया. 🙂 😀 🚀 🎉 👍 ❤️ 🤖 ✅ — “quotes” ‘single’ … €£¥",
)


@dataclass(frozen=True)
class Family:
    """What makes one test tokenizer: its special tokens, template and config tokens."""

    name: str
    specials: tuple[str, ...]
    chat_template: str
    config_tokens: dict[str, str]
    added: tuple[str, ...] = ()
    bos_prefix: str | None = None  # a BOS the post-processor adds (tests the kwargs encode path)
    extra_config: dict[str, object] = field(default_factory=dict)


KIMI_K25 = Family(
    name="kimi-k2.5",
    specials=KIMI_SPECIALS,
    chat_template=_KIMI_MACROS + _KIMI_HEAD + _K25_SUFFIX,
    config_tokens={"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"},
)
KIMI_K2_THINKING = Family(
    name="kimi-k2-thinking",
    specials=KIMI_SPECIALS,
    chat_template=_KIMI_MACROS + _KIMI_HEAD + _K2_THINKING_SUFFIX,
    config_tokens={"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"},
)
CHATML = Family(
    name="chatml-qwen3",
    specials=CHATML_SPECIALS,
    added=CHATML_ADDED,
    chat_template=_CHATML_TEMPLATE,
    config_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
)
QWEN3 = Family(
    name="qwen3",
    specials=CHATML_SPECIALS,
    added=CHATML_ADDED,
    chat_template=_QWEN3_TEMPLATE,
    config_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
)
# The real tokenizer adds BOS on a plain encode and the template writes it too: the rebuild must
# encode the rendered prompt without adding another.
DEEPSEEK = Family(
    name="deepseek-v3.1",
    specials=DEEPSEEK_SPECIALS,
    added=DEEPSEEK_ADDED,
    chat_template=_DEEPSEEK_TEMPLATE,
    config_tokens={"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                   "pad_token": "<｜▁pad▁｜>"},
    bos_prefix="<｜begin▁of▁sentence｜>",
)
FAMILIES = (KIMI_K25, KIMI_K2_THINKING, CHATML, QWEN3, DEEPSEEK)


def build_backend(family: Family) -> Tokenizer:
    """A byte-level BPE trained on ``_CORPUS`` with the family's tokens added above its vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    if family.bos_prefix is not None:
        bos_id = tok.token_to_id(family.bos_prefix)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{family.bos_prefix} $A", special_tokens=[(family.bos_prefix, bos_id)]
        )
    return tok


def write_tokenizer(family: Family, directory: Path, *, chat_template: str | None = None) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) to ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    build_backend(family).save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "chat_template": chat_template if chat_template is not None else family.chat_template,
        **family.config_tokens,
        **family.extra_config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


# A remote-code tokenizer in the way Kimi's is shipped (``auto_map`` + a module next to the files):
# chatty on every kwargs encode like Kimi's, and optionally with a decode bug like transformers'
# ≥5.4 one on K2.5 (ids from a threshold on decode as the wrong token).
_REMOTE_MODULE = '''
import logging

from transformers import TokenizersBackend

logger = logging.getLogger(__name__)


class ChattyTokenizer(TokenizersBackend):
    def encode(self, text, **kwargs):
        if kwargs:
            logger.warning(f"Calling super().encode with {kwargs}")
            print(f"Calling super().encode with {kwargs}")
        return super().encode(text, **kwargs)


class PlainTextSpecialsTokenizer(ChattyTokenizer):
    # Lists as added tokens only the special tokens its config names (as Kimi's remote code does)
    # and encodes every special token's text as ordinary tokens.
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.split_special_tokens = True
        self._named_only = True

    @property
    def added_tokens_decoder(self):
        tokens = super().added_tokens_decoder
        if not getattr(self, "_named_only", False):  # still initialising
            return tokens
        named = set(self.all_special_tokens)
        return {i: t for i, t in tokens.items() if t.content in named}


class BuggyDecodeTokenizer(ChattyTokenizer):
    first_bad_id = {first_bad_id}

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        ids = [i - 1 if i >= self.first_bad_id else i for i in ids]
        return super()._decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
'''


def write_remote_tokenizer(family: Family, directory: Path, *, class_name: str, first_bad_id_token: str) -> Path:
    """Like ``write_tokenizer`` but loaded through ``trust_remote_code`` as ``class_name``."""
    write_tokenizer(family, directory)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    first_bad_id = backend.token_to_id(first_bad_id_token)
    (directory / "tokenization_remote.py").write_text(_REMOTE_MODULE.replace("{first_bad_id}", str(first_bad_id)))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, f"tokenization_remote.{class_name}"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=[f.name for f in FAMILIES])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args()
    family = next(f for f in FAMILIES if f.name == args.family)
    print(write_tokenizer(family, args.directory))


if __name__ == "__main__":
    main()
