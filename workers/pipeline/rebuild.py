"""The rebuild, for the pipeline: it lives in ``common/rebuild.py`` since ``specfleet validate``
(``producer/validate.py``) rebuilds a row's completion with the same code the workers build it with."""

from common.rebuild import (
    ENDED_FINISH_REASONS,
    AnswerParts,
    ReasoningEnd,
    RebuiltRow,
    RenderedPrompt,
    rebuild,
    render_prompt,
)
from workers.upstreams.upstream import Answer

__all__ = ["ENDED_FINISH_REASONS", "Answer", "AnswerParts", "ReasoningEnd", "RebuiltRow", "RenderedPrompt",
           "rebuild", "render_prompt"]
