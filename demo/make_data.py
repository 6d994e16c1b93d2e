"""Writes the demo's two datasets (deterministic; run again to regenerate the shipped files).

B1_glaive: short prompts with tool definitions (OpenAI form), as glaive function-calling rows.
B4_mixturethoughts: reasoning prompts in ShareGPT form, as MixtureOfThoughts rows.
Each file holds a few malformed rows on purpose: the demo shows them reported and skipped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

CITIES = ["Paris", "Tōkyō", "São Paulo", "Zürich", "Nairobi", "Reykjavík", "Lima", "Kraków"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {"amount": {"type": "number"},
                                                         "from": {"type": "string"}, "to": {"type": "string"}},
                       "required": ["amount", "from", "to"]}}},
]
TOPICS = ["prime gaps", "the Collatz map", "Bayes' rule", "heat diffusion", "graph colouring",
          "modular inverses", "the birthday paradox", "binary search invariants", "entropy of a die"]


def glaive(n: int, rng: random.Random) -> list[str]:
    rows = []
    for i in range(n):
        city = rng.choice(CITIES)
        ask = rng.choice([
            f"What's the weather in {city} right now?",
            f"Convert {rng.randint(5, 900)} EUR to JPY please.",
            f"Should I pack an umbrella for {city} tomorrow? 🌧️",
            f"Explain in two sentences why {city} is worth visiting.",
        ])
        rows.append(json.dumps({"id": f"b1-{i:05d}", "messages": [
            {"role": "system", "content": "You are a helpful assistant with access to tools."},
            {"role": "user", "content": ask}], "tools": TOOLS}, ensure_ascii=False))
    rows.insert(7, '{"id": "b1-broken-json", "messages": [')
    rows.insert(31, json.dumps({"id": "b1-no-user", "messages": [{"role": "system", "content": "hi"}]}))
    return rows


def mixture(n: int, rng: random.Random) -> list[str]:
    rows = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        q = f"Think carefully, then explain {topic} with a worked example (case {rng.randint(1, 99)})."
        conv = [{"from": "human", "value": q}, {"from": "gpt", "value": "(the dataset's old answer)"}]
        row = {"conversations": conv} if i % 5 == 0 else {"id": f"b4-{i:05d}", "conversations": conv}
        rows.append(json.dumps(row, ensure_ascii=False))
    rows.insert(12, json.dumps({"id": "b4-bad-speaker", "conversations": [{"from": "robot", "value": "?"}]}))
    return rows


def main() -> None:
    rng = random.Random(20261130)
    (HERE / "data").mkdir(exist_ok=True)
    (HERE / "data" / "b1_glaive.jsonl").write_text("\n".join(glaive(1500, rng)) + "\n", encoding="utf-8")
    (HERE / "data" / "b4_mixturethoughts.jsonl").write_text(
        "\n".join(mixture(300, rng)) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
