"""Multi-turn datasets for ``regenerate = "all"`` runs, and the checks their output must pass.

Shared by the fleet test (``tests/test_fleet_conversation.py``) and the bench
(``bench/conversations_run.py``): conversations with 2–4 assistant turns, some declaring tools (the
simulator then calls them at its ``tool_call_rate``: the conversation ends there), some with a tool
call and its result in the dataset's own history (a turn that calls no tool ends it: the dataset's
result answers a call never made).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from simulator.seeding import prompt_hash

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the dictionary.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]


def conversations(n: int, prefix: str = "c", *, seed: int = 0, tools_share: float = 0.3,
                  tool_history_share: float = 0.1) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = rng.randint(2, 4)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are brief."}] if i % 2 else []
        row: dict[str, Any] = {"id": f"{prefix}{i:05d}"}
        if rng.random() < tool_history_share:
            call = {"id": "functions.lookup:0", "type": "function",
                    "function": {"name": "lookup", "arguments": f'{{"word": "w{i}"}}'}}
            messages += [{"role": "user", "content": f"Conversation {i}: look up w{i}."},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "functions.lookup:0", "content": f"w{i}: a word ✓"}]
            row["tools"] = TOOLS
        for t in range(turns):
            messages.append({"role": "user", "content": f"Conversation {i}, question {t}: explain {i * 7 + t} ✓"})
            messages.append({"role": "assistant", "content": f"The dataset's answer {t}."})
        if "tools" not in row and rng.random() < tools_share:
            row["tools"] = TOOLS
        row["messages"] = messages[:-1]  # the last answer is the target's to give
        rows.append(row)
    return rows


@dataclass
class RowCheck:
    rows: int = 0
    conversations: int = 0
    #: Rows whose prompt ids differ from apply_chat_template on their own history.
    prompt_mismatch: int = 0
    #: Rows whose shape is wrong (loss mask, counts) or whose turns are not 0..n-1 once each.
    bad: list[str] = field(default_factory=list)
    turns_per_conversation: Counter[int] = field(default_factory=Counter)
    ends: Counter[str] = field(default_factory=Counter)


def check_rows(rows: list[dict[str, Any]], tokenizer: Path) -> RowCheck:
    """Every row token-exact against an oracle independent of the rebuild (the tokenizer's own
    template on the row's history), and every conversation's turns 0..n-1 kept once each."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    out = RowCheck(rows=len(rows))
    keys = Counter(r["key"] for r in rows)
    out.bad += [f"{k} kept {c} times" for k, c in keys.items() if c > 1]
    by_conversation: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_conversation[r["id"]].append(r)
        if r["key"] != f"{r['id']}#{r['turn']}":
            out.bad.append(f"{r['key']}: key does not name id and turn")
        n = r["loss_mask"].index(1) if 1 in r["loss_mask"] else len(r["loss_mask"])
        if r["loss_mask"] != [0] * n + [1] * (len(r["input_ids"]) - n) or sum(r["loss_mask"]) != r["num_tokens"]:
            out.bad.append(f"{r['key']}: loss mask")
        kwargs = {"tools": r["tools"]} if r.get("tools") else {}
        text = tok.apply_chat_template(r["conversations"][:-1], tokenize=False, add_generation_prompt=True, **kwargs)
        if tok(text, add_special_tokens=False)["input_ids"] != r["input_ids"][:n]:
            out.prompt_mismatch += 1
    out.conversations = len(by_conversation)
    for cid, turns in by_conversation.items():
        turns.sort(key=lambda r: r["turn"])
        if [r["turn"] for r in turns] != list(range(len(turns))):
            out.bad.append(f"{cid}: turns {[r['turn'] for r in turns]}")
        for a, b in itertools.pairwise(turns):
            if b["conversations"][:len(a["conversations"])] != a["conversations"]:
                out.bad.append(f"{b['key']}: history is not turn {a['turn']}'s conversation")
        if any("conversation_end" in r for r in turns[:-1]):
            out.bad.append(f"{cid}: a row before the last says the conversation ended")
        out.turns_per_conversation[len(turns)] += 1
        out.ends[turns[-1].get("conversation_end") or "open"] += 1
    return out


def billed_twice(generations: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Billing:
    """The simulator's ledger against the rows: it names a request by the hash of its messages, and
    a turn's messages are its row's history, so each billed request maps to the turn it asked."""
    turn_of = {prompt_hash(r["conversations"][:-1]): r["key"] for r in rows}
    out = Billing(requests=len(generations))
    seen: Counter[str] = Counter()
    for g in generations:
        key = turn_of.get(g["prompt_hash"])
        if key is None:
            out.not_kept += 1
            continue
        seen[key] += 1
        if seen[key] > 1:
            out.twice.add(key)
            out.extra += 1
            out.abandoned += bool(g["abandoned"])
    return out


@dataclass
class Billing:
    requests: int = 0
    #: Billed requests that are no kept turn (a failed or discarded turn, or a bug).
    not_kept: int = 0
    #: Billings beyond the first of a kept turn, the turns they were, and how many of those billings
    #: the simulator saw abandoned (the client gone before the answer was ready).
    extra: int = 0
    twice: set[str] = field(default_factory=set)
    abandoned: int = 0
