"""Every row field README.md documents is in the rows a real fleet writes.

The table is read from README.md's Output section, so the test follows the docs: a field added to
the table must reach every row, and a field the code stops writing (``reasoning_end`` dropped from
the row, say) fails here though every row still loads and trains.
"""

from __future__ import annotations

import re

import redis

from tests.fleet import REPO, Fleet, prompts, write_jsonl

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

_FIELD_ROW = re.compile(r"^\| (?P<fields>`[^|]+`) \| (?P<where>[^|]+) \|")


def documented_fields() -> dict[str, str]:
    """README's row-field table: field -> the rows it is in ("every row", "prompts with tools", …)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Output\n", 1)[1].split("\n## ", 1)[0]
    fields: dict[str, str] = {}
    for line in section.splitlines():
        if m := _FIELD_ROW.match(line):
            for name in re.findall(r"`([^`]+)`", m["fields"]):
                fields[name] = m["where"].strip()
    return fields


def test_the_readme_table_is_found() -> None:
    fields = documented_fields()
    every = [f for f, where in fields.items() if where == "every row"]
    assert {"id", "input_ids", "loss_mask", "reasoning_end", "usage"} <= set(every), fields
    assert fields["tools"] == "prompts with tools"


def test_every_documented_row_field_is_in_every_row_of_a_run(fleet: Fleet, redis_client: redis.Redis) -> None:
    fields = documented_fields()
    tool = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    rows: list[dict[str, object] | str] = [*prompts(6)]
    rows += [{"messages": [{"role": "user", "content": f"A prompt without an id, number {i}."}]} for i in range(3)]
    rows += [{"id": f"tool{i}", "messages": [{"role": "user", "content": f"Look up item {i}."}], "tools": tool}
             for i in range(3)]
    data = write_jsonl(fleet.tmp / "rows.jsonl", rows)
    fleet.start_simulator("--latency-median-ms", "10")
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(fleet.write_config([{"name": "R", "path": data, "length": "short"}]))
    written = fleet.assert_exactly_once(redis_client, "R", len(rows))
    every = [f for f, where in fields.items() if where == "every row"]
    for row in written:
        missing = [f for f in every if f not in row]
        assert not missing, f"row {row['id']} lacks documented field(s) {missing}"
    with_tools = [r for r in written if r["id"].startswith("tool")]
    assert len(with_tools) == 3 and all(r.get("tools") == tool for r in with_tools)
    assert sum(r["id"].startswith("h-") for r in written) == 3
    # Nothing undocumented either: a field the rows carry is in the table.
    undocumented = {f for r in written for f in r} - set(fields)
    assert not undocumented, f"rows carry fields README.md does not document: {sorted(undocumented)}"
