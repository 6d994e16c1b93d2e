"""Every row field the manual documents is in the rows a real fleet writes.

The table is read from the manual's row-field reference (docs/reference/rows.md, generated from the
row contract by ops/gen_reference.py), so the test follows the docs: a field the contract marks as in
every row must reach every row, and a field the code stops writing (``reasoning_end`` dropped from
the row, say) fails here though every row still loads and trains.
"""

from __future__ import annotations

import re

import redis

from tests.fleet import REPO, Fleet, prompts, write_jsonl

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


def documented_fields() -> dict[str, str]:
    """The reference's row-field table: field -> the rows it is in ("every row", "prompts with tools", …)."""
    fields: dict[str, str] = {}
    for line in (REPO / "docs" / "reference" / "rows.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and (m := re.fullmatch(r"`([^`]+)`", cells[0])):
            fields[m[1]] = cells[2]
    return fields


def test_the_reference_table_is_found() -> None:
    fields = documented_fields()
    every = [f for f, where in fields.items() if where == "every row"]
    assert {"id", "input_ids", "loss_mask", "reasoning_end", "usage", "where", "manifest"} <= set(every), fields
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
