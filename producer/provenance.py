"""What served a dataset's rows: the provider mix (rows per provider and quantization) and the rows
cut by max_tokens, read off the output folder at the dataset's end, and the run manifest
(``common/manifest.py``) completed with them when the run ends.

Read from the files, not counted on the way: the folder is what a trainer gets, rows of earlier runs
of the same folder included, so the mix is the data's own (``summary.json``, ``report.md`` and
``manifest.json`` agree with what ``specfleet validate`` re-reads).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from common.manifest import DatasetProvenance, Manifest, now_iso
from common.providers import mix_key, quantization_of
from common.quality import is_degenerate
from producer.rows import DEGENERATE_FILE, DROPPED_FILE, TRUNCATED_FILE, is_truncated
from producer.summary import Summary

log = logging.getLogger(__name__)


@dataclass
class OutputMix:
    #: ``"<provider>|<quantization>"`` -> rows (shards, truncated.jsonl and dropped stubs).
    providers: dict[str, int] = field(default_factory=dict)
    #: Rows whose finish_reason is ``length``, wherever they went.
    truncated_rows: int = 0
    #: Rows marked degenerate, by reason (``quality.degenerate``), wherever they went.
    degenerate: dict[str, int] = field(default_factory=dict)
    #: Sampling recipe -> rows and kept tokens (the budget's: every row, wherever it went).
    recipe_rows: dict[str, int] = field(default_factory=dict)
    recipe_tokens: dict[str, int] = field(default_factory=dict)

    def warning(self) -> str | None:
        """Why the rows are a mixture of distributions, if they are: more than one provider, or more
        than one quantization, served them."""
        names = {k.split("|", 1)[0] for k in self.providers}
        quantizations = {k.split("|", 1)[1] for k in self.providers}
        if len(names) <= 1 and len(quantizations) <= 1:
            return None
        mix = ", ".join(f"{k} {n:,}" for k, n in sorted(self.providers.items(), key=lambda kv: -kv[1]))
        return (f"rows from {len(names)} providers / {len(quantizations)} quantizations ({mix}): a drafter trained "
                "on them learns a mixture; [request] providers = \"pin\" keeps one")


def output_files(folder: Path) -> list[Path]:
    return [*sorted(folder.glob("shard-*.jsonl")), *(folder / name for name in (TRUNCATED_FILE, DEGENERATE_FILE,
                                                                                DROPPED_FILE))]


def read_mix(folder: Path, quantizations: dict[str, str] | None) -> OutputMix:
    """The mix of a dataset's folder. A row's own ``quantization`` wins; rows without one (written
    before it was recorded) take the endpoints list's for their provider."""
    providers: Counter[str] = Counter()
    truncated = 0
    degenerate: Counter[str] = Counter()
    recipe_rows: Counter[str] = Counter()
    recipe_tokens: Counter[str] = Counter()
    for path in output_files(folder):
        if not path.is_file():
            continue
        with path.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = orjson.loads(line)
                provider = str(row.get("provider") or "")
                providers[mix_key(provider, row.get("quantization") or quantization_of(quantizations, provider))] += 1
                truncated += is_truncated(row)
                if is_degenerate(row):
                    degenerate[row["quality"]["degenerate"]] += 1
                if isinstance(sampling := row.get("sampling"), dict):
                    recipe = str(sampling.get("recipe"))
                    recipe_rows[recipe] += 1
                    recipe_tokens[recipe] += int(row.get("num_tokens") or 0)
    return OutputMix(providers=dict(providers), truncated_rows=truncated, degenerate=dict(degenerate),
                     recipe_rows=dict(recipe_rows), recipe_tokens=dict(recipe_tokens))


def finish_manifest(manifest: Manifest, summaries: list[Summary]) -> Manifest:
    """The manifest at the run's end: each dataset's mix and truncated rows, the end time."""
    datasets = dict(manifest.datasets)
    for s in summaries:
        base = datasets.get(s.dataset) or DatasetProvenance(budget_tokens=s.budget_tokens, budget_usd=s.budget_usd)
        datasets[s.dataset] = base.model_copy(update={
            "providers": dict(s.providers), "truncated": s.truncated_rows, "duplicate_prompts": s.duplicate_prompts,
            "excluded": s.excluded, "shared_rows": s.shared_rows, "degenerate": dict(s.degenerate_rows),
            "recipe_tokens": dict(s.recipe_tokens)})
    return manifest.model_copy(update={"datasets": datasets, "ended_at": now_iso()})


__all__ = ["OutputMix", "finish_manifest", "output_files", "read_mix"]
