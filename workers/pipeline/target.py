"""The target's tokenizer, for the pipeline: it lives in ``common/target.py`` since ``specfleet
validate`` (``producer/validate.py``) re-checks rows with the same code the workers build them with."""

from common.target import StrippedEdges, TargetTokenizer, ToolCallStyle, TurnFormat

__all__ = ["StrippedEdges", "TargetTokenizer", "ToolCallStyle", "TurnFormat"]
