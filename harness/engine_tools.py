"""The real-engine tier's helpers that run inside the engine's venv (``make engine``: llama-cpp-python,
gguf, tokenizers), never the project's: run it as a script, ``.venv-engine/bin/python
harness/engine_tools.py tokenizers|truth …``. It imports nothing of the project.

- ``tokenizers GGUF OUT``: two Hugging Face tokenizer folders from the model's GGUF. ``OUT/exact`` has
  the model's own pre-tokenizer (llama.cpp's ``smollm``: every digit its own piece, then GPT-2's byte
  level split) and is checked against ``llama_cpp``'s tokenizer on every test string: one that
  differs fails the command, naming it. ``OUT/converted`` is what ``transformers``' GGUF converter
  gives for this file (byte level only: its converter does not know the digit split), kept as the
  wrong tokenizer the fleet must notice; the command says how many test strings it gets wrong and
  fails if none (a negative that tokenizes right proves nothing).
- ``truth GGUF PROMPTS MAX_TOKENS``: the engine's own ids for each prompt of a JSONL file, one JSON
  line each: the prompt as llama-cpp-python's server renders and tokenizes it (the GGUF's chat
  template, special tokens parsed), and its greedy completion (temperature 0, no repeat penalty), the
  end-of-turn token it stopped on left out, as the server leaves it out of ``usage``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: token_type values in a GGUF vocabulary (gguf.TokenType): control tokens are the specials.
CONTROL, USER_DEFINED = 3, 4

#: Strings the tokenizers are compared on, beside every prompt's text: digits next to letters,
#: spaces and punctuation (where the converter goes wrong), scripts, emoji, code, special tokens.
PROBES = [
    "x  9", "a1b2c3", "2024-12-04", "3.14159", "  42  ", "v1.2.3-rc4", "1,234,567", "12345678901234567890",
    "Call 555-0199 now!", "0x1F", "H2O and CO2", "rock'n'roll", "I'm you're we've they'll she'd",
    "日本語のテキスト123", "مرحبا بالعالم ١٢٣", "emoji 😀👍🏽 family 👨‍👩‍👧", "tab\tnew\nline\r\n", "   leading",
    "trailing   ", "def f(x):\n    return x ** 2  # 2x", "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>",
    "naïve café résumé", "Ünïcödé ß ẞ", "😀" * 5, "a" * 100, "9" * 33, " 9 99 999", "$5.00 & €6,50",
]


def _reader_fields(gguf_path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    wanted = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.chat_template", "tokenizer.ggml.pre")
    return {name: reader.fields[name].contents() for name in wanted if name in reader.fields}


def _tokenizer_json(fields: dict[str, Any], *, digits: bool) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    kinds: list[int] = fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer: "\p{N}" first (each digit alone), then GPT-2's regex.
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, kinds, strict=True) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, kinds, strict=True) if k == USER_DEFINED])
    return tok.to_str()


def _write_folder(folder: Path, fields: dict[str, Any], *, digits: bool) -> None:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(_tokenizer_json(fields, digits=digits))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": fields["tokenizer.chat_template"],
        "bos_token": tokens[fields["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[fields["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[fields["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[fields.get("tokenizer.ggml.padding_token_id", fields["tokenizer.ggml.eos_token_id"])],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _vocab_only(gguf_path: Path) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)


def tokenizers_cmd(gguf_path: Path, out: Path, extra: list[str]) -> int:
    from tokenizers import Tokenizer

    fields = _reader_fields(gguf_path)
    if fields.get("tokenizer.ggml.pre") != "smollm":
        print(f"{gguf_path}: pre-tokenizer {fields.get('tokenizer.ggml.pre')!r}, this builder knows 'smollm' only")
        return 2
    _write_folder(out / "exact", fields, digits=True)
    _write_folder(out / "converted", fields, digits=False)
    engine = _vocab_only(gguf_path)
    exact = Tokenizer.from_file(str(out / "exact" / "tokenizer.json"))
    converted = Tokenizer.from_file(str(out / "converted" / "tokenizer.json"))
    strings = PROBES + extra
    wrong = 0
    for text in strings:
        want = engine.tokenize(text.encode(), add_bos=False, special=True)
        got = exact.encode(text, add_special_tokens=False).ids
        if got != want:
            print(f"{out / 'exact'}: {text!r} tokenizes to {got}, llama.cpp to {want}")
            return 1
        wrong += converted.encode(text, add_special_tokens=False).ids != want
    print(f"exact: {len(strings)} of {len(strings)} strings as llama.cpp; converted: {wrong} differ")
    if not wrong:
        print(f"{out / 'converted'}: tokenizes every string right; it cannot serve as the wrong tokenizer")
        return 1
    return 0


def truth_cmd(gguf_path: Path, prompts: Path, max_tokens: int) -> int:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    llm = Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=1, verbose=False)
    meta = llm.metadata
    eos = llm.token_eos()
    # How llama-cpp-python's server renders a chat for a GGUF with a template (Llama.__init__).
    formatter = Jinja2ChatFormatter(template=meta["tokenizer.chat_template"],
                                    eos_token=llm._model.token_get_text(eos),
                                    bos_token=llm._model.token_get_text(llm.token_bos()))
    for line in prompts.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        rendered = formatter(messages=item["messages"])
        prompt_ids = llm.tokenize(rendered.prompt.encode(), add_bos=not rendered.added_special, special=True)
        completion: list[int] = []
        stopped = False
        for token in llm.generate(prompt_ids, temp=0.0, repeat_penalty=1.0, reset=True):
            if llm._model.token_is_eog(token) if hasattr(llm._model, "token_is_eog") else token == eos:
                stopped = True
                break
            completion.append(token)
            if len(completion) >= max_tokens:
                break
        print(json.dumps({"id": item["id"], "prompt_ids": prompt_ids, "completion_ids": completion,
                          "stopped": stopped, "eos": eos}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "tokenizers":
        extra = [json.loads(line)["text"] for line in Path(argv[3]).read_text().splitlines()] if len(argv) > 3 else []
        return tokenizers_cmd(Path(argv[1]), Path(argv[2]), extra)
    if len(argv) == 4 and argv[0] == "truth":
        return truth_cmd(Path(argv[1]), Path(argv[2]), int(argv[3]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
