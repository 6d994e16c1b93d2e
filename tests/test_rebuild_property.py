"""Property: any answer OpenRouter can return, on any of the three test tokenizers, rebuilds into a
row that passes every self-check (``rebuild`` raises ``TokenMismatch`` otherwise).

Texts include special-token strings, near-misses, emoji, other scripts, "" and None
(``tests/strategies.py``). The only inputs left out are lone surrogates, which are not text: see
that module's docstring. The simulator and worker-path version of this property builds on the
same strategies.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from tests.strategies import answers_messages, conversations
from tests.test_rebuild import FAMILY_NAMES, targets  # noqa: F401  (the session fixture, used by name)
from workers.openrouter import answer_from_message
from workers.rebuild import rebuild
from workers.target import TargetTokenizer


@pytest.mark.parametrize("family", FAMILY_NAMES)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversation=conversations(), choice=answers_messages())
def test_every_answer_rebuilds_and_passes_the_self_check(
    request: pytest.FixtureRequest,
    family: str,
    conversation: tuple[list[dict[str, Any]], list[dict[str, Any]] | None],
    choice: dict[str, Any],
) -> None:
    target: TargetTokenizer = request.getfixturevalue("targets")[family]
    messages, tools = conversation
    answer = answer_from_message(choice["message"], choice["finish_reason"])
    row = rebuild(target, messages, tools, answer)

    assert row.input_ids[: row.prompt_tokens] == target.prompt_ids(messages, tools)
    assert row.loss_mask == [0] * row.prompt_tokens + [1] * row.completion_tokens
    assert row.completion_tokens == sum(row.loss_mask) == len(row.input_ids) - row.prompt_tokens
    assert target.decode(row.input_ids[row.prompt_tokens :]) == row.completion_text
    end = target.turn_format.end_of_turn
    if answer.finish_reason in ("stop", "tool_calls"):
        assert row.completion_text.endswith(end)
        assert row.input_ids[-1] == target.special_ids_by_string[end]
    else:
        # Only a finished generation gets an end-of-turn token; a leaked one was stripped.
        assert not row.completion_text.endswith(end)
