"""``specfleet plan``: what a run will cost, and whether it can start, before the first paid request.

For each dataset: its prompts and their prompt tokens (with the target tokenizer, as the model will
see them), the rows expected to reach its token budget and their cost, expected and worst case,
priced from the models endpoint (``producer/models.py``). It refuses, before anything is sent, when
the model id is unknown or a prompt plus ``max_tokens`` cannot fit the context length (naming the
rows), and asks for ``--yes`` (or ``[run] confirm_over_budget = true``) when the worst case exceeds
``[run] budget_usd``.

The estimates: an answer is expected to keep ``estimate_tokens`` of its length class, or
``max_tokens / 4`` when that is not set; the worst case is the same requests each answered with
``max_tokens``. A dataset of more than ``exact_limit`` prompts is counted on a deterministic sample
of that many (a seeded reservoir) and extrapolated; the output says so. The context-length check
still covers every prompt: outside the sample, each prompt whose text is long enough in bytes to
possibly overflow is counted too (a byte-level BPE token is at least one byte).

The account (``producer/account.py``): the balance and the key's limit, read with the run's key.
The plan refuses (unless ``--yes``) when the worst case, capped by ``[run] budget_usd``, exceeds
what the key can spend, and says how many worst-case requests (prompt + ``max_tokens`` at the
model's price) the balance covers in flight at once: the account's in-flight budget refuses more
(a 402 that slows the fleet). Without ``[request] max_in_flight`` the fleet's in-flight limit
starts there (``[request] start_in_flight``), bounded from the files' bytes because requests may
leave before the counts are in.

``specfleet run`` splits it: the models endpoint first (``read_model``: an unknown model stops the
run before anything is queued), then the counts (``PendingPlan``) beside the run's start, which
queues prompts for workers to prepare but holds every request until the counts pass, or until a
bound from the files' bytes alone shows they cannot refuse the run (``clears_by_bytes``).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from common.config import DatasetConfig, LengthClass, Pricing, RunConfig
from common.datasets import Prompt, ReadStats, dataset_problem, is_plain_jsonl, row_sizes
from common.endpoints import Endpoints
from common.errors import DatasetRowError, ModelsUnavailable, PlanRefused, SpecfleetError
from common.prompt_filter import RunFilter
from common.prompt_tokens import count_prompt_tokens, load_tokenizer, tokens_bound
from producer.account import Account, fetch_account, fit_in_flight, worst_request_usd
from producer.distillation import read_permission
from producer.models import ModelInfo, fetch_model
from producer.providers import ModelEndpoints, apply_endpoints

log = logging.getLogger(__name__)

#: Prompts counted exactly for the estimates; beyond it a seeded sample (the mean of 2,000 is within
#: a few per cent), while every prompt that might not fit the context is still counted. Counting
#: 20,000 cost the producer ~2 s of CPU before the first request (0.3 ms per row of a 6,000-row run).
EXACT_LIMIT = 2_000
_SAMPLE_SEED = 20_260_101
_MAX_NAMED_ROWS = 20
_COUNT_BATCH = 512
_SCAN_CHUNK_BYTES = 1 << 20
#: Counts the byte bound made optional wait at most this long for the first wave to leave.
COUNTS_WAIT_MAX_S = 10.0


@dataclass
class DatasetPlan:
    name: str
    prompts: int
    malformed: int
    counted: int
    prompt_tokens: int
    max_prompt_tokens: int
    max_tokens: int
    expected_completion: int
    expected_rows: int
    #: ``file:line (N tokens)`` of prompts that cannot fit prompt + max_tokens in the context.
    too_long: list[str] = field(default_factory=list)
    expected_usd: float | None = None
    worst_usd: float | None = None
    #: One request's worst case at the counted mean prompt, and how many the balance covers at once.
    worst_request_usd: float | None = None
    fit_in_flight: int | None = None
    #: How its requests go: ``live`` or ``batch`` (``auto`` resolved), and whether batch could.
    mode: str = "live"
    can_batch: bool = False
    #: Expected dollars each way (the model's price, its :batch variant's); None: unknown.
    live_expected_usd: float | None = None
    batch_expected_usd: float | None = None
    #: Prompts not asked (common/prompt_filter.py): duplicates of an earlier prompt of the run, and
    #: eval leaks; and the dollars the duplicates would have cost, at the dataset's expected cost a prompt.
    duplicate_prompts: int = 0
    excluded: int = 0
    saved_usd: float | None = None
    #: Every prompt's expected cost, the duplicates' included (what ``saved_usd`` is a share of).
    all_prompts_usd: float | None = None

    @property
    def sampled(self) -> bool:
        return self.counted < self.prompts


@dataclass
class Plan:
    model: str
    url: str
    context_length: int | None
    pricing: Pricing | None
    datasets: list[DatasetPlan]
    #: Why prices are unknown (the endpoint's error), when they are.
    unavailable: str | None = None
    #: The balance and the key's limit (None: not asked, e.g. a plan without a key).
    account: Account | None = None
    #: Where the fleet's in-flight limit starts ([request] start_in_flight), when set.
    start_in_flight: int | None = None
    #: The run's own cap ([request] max_in_flight), when set.
    max_in_flight: int | None = None
    #: The models list's ``is_trainable_text`` (None: not stated; producer/distillation.py refuses False).
    distillable: bool | None = None

    def total(self, attr: str) -> float | None:
        values = [getattr(d, attr) for d in self.datasets]
        return None if any(v is None for v in values) else sum(values)


def _sample(prompts: list[tuple[int, Prompt]], seen: int, prompt: Prompt, rng: random.Random, k: int) -> None:
    if len(prompts) < k:
        prompts.append((seen, prompt))
        return
    j = rng.randrange(seen)
    if j < k:
        prompts[j] = (seen, prompt)


def _count(tokenizer: object, prompts: list[Prompt]) -> list[int]:
    counts: list[int] = []
    for start in range(0, len(prompts), _COUNT_BATCH):
        counts += count_prompt_tokens(tokenizer, prompts[start:start + _COUNT_BATCH])
    return counts


def _payload_bytes(prompt: Prompt) -> int:
    return len(json.dumps([prompt.messages, prompt.tools], ensure_ascii=False).encode())


def _rows_to_budget(ds: DatasetConfig, length: LengthClass, prompts: int) -> tuple[int, int]:
    """The completion tokens a row is expected to keep, and the rows that reach the token budget."""
    expected = length.estimate_tokens or max(1, length.max_tokens // 4)
    return expected, min(prompts, math.ceil(ds.budget_tokens / expected))


def plan_dataset(cfg: RunConfig, ds: DatasetConfig, tokenizer: object, info: ModelInfo | None, *,
                 exact_limit: int = EXACT_LIMIT, account: Account | None = None,
                 prompt_filter: RunFilter | None = None) -> DatasetPlan:
    """``prompt_filter``: the run's (one for all its datasets, in order): what the run leaves out, left out."""
    length = cfg.length_for(ds.length)
    context = cfg.model.context_length or (info.context_length if info else None)
    room = None if context is None else context - length.max_tokens
    errors: list[DatasetRowError] = []
    stats = ReadStats()
    rng = random.Random(_SAMPLE_SEED)
    sample: list[tuple[int, Prompt]] = []
    # Outside the sample, a prompt is counted too when it might not fit: a byte-level token is at
    # least one byte, so a prompt far shorter in bytes than the room left cannot overflow it. The
    # suspects are counted a batch at a time and only those over the room kept (their place, the
    # count): a file of long prompts costs one batch of memory, not the file.
    suspects: list[tuple[int, Prompt]] = []
    over: dict[int, tuple[str, int]] = {}

    def count_suspects() -> None:
        for (seq, p), n in zip(suspects, _count(tokenizer, [p for _, p in suspects]), strict=True):
            if room is not None and n > room:
                over[seq] = (p.where, n)
        suspects.clear()

    prompt_filter = prompt_filter or RunFilter(cfg)
    for seen, prompt in enumerate(prompt_filter.read(ds, errors, stats), start=1):
        _sample(sample, seen, prompt, rng, exact_limit)
        if room is not None and tokens_bound(_payload_bytes(prompt)) > room:
            suspects.append((seen, prompt))
            if len(suspects) >= _COUNT_BATCH:
                count_suspects()
    count_suspects()
    counts = _count(tokenizer, [p for _, p in sample])
    too_long: list[str] = []
    if context is not None and room is not None:
        for (seq, p), n in zip(sample, counts, strict=True):
            if n > room:
                over[seq] = (p.where, n)
        too_long = [f"{where} ({n:,} prompt tokens + max_tokens {length.max_tokens:,} > context {context:,})"
                    for _, (where, n) in sorted(over.items())]
    prompt_tokens = round(sum(counts) * stats.prompts / len(counts)) if counts else 0
    expected, rows = _rows_to_budget(ds, length, stats.prompts)
    plan = DatasetPlan(
        name=ds.name, prompts=stats.prompts, malformed=stats.malformed + stats.duplicates, counted=len(counts),
        prompt_tokens=prompt_tokens, max_prompt_tokens=max(counts, default=0), max_tokens=length.max_tokens,
        expected_completion=expected, expected_rows=rows, too_long=too_long,
        duplicate_prompts=stats.duplicate_prompts, excluded=stats.excluded,
    )
    applied = apply_model(cfg, info)
    plan.mode, batch_pricing = applied.dataset_mode(ds), applied.model.batch_pricing
    plan.can_batch = batch_pricing is not None and ds.regenerate == "last"
    live_pricing = cfg.model.pricing or (info.pricing if info else None)
    pricing = batch_pricing if plan.mode == "batch" else live_pricing
    if stats.prompts:
        mean = prompt_tokens / stats.prompts
        for price, attr in ((live_pricing, "live_expected_usd"), (batch_pricing, "batch_expected_usd")):
            if price is not None:
                setattr(plan, attr, rows * (mean * price.prompt + price.request + expected * price.completion))
        if pricing is not None:
            per_prompt = mean * pricing.prompt + pricing.request + expected * pricing.completion
            plan.saved_usd = stats.duplicate_prompts * per_prompt
            plan.all_prompts_usd = (stats.prompts + stats.duplicate_prompts) * per_prompt
    if pricing is not None and stats.prompts:
        mean_prompt = prompt_tokens / stats.prompts
        per_request = mean_prompt * pricing.prompt + pricing.request
        plan.expected_usd = rows * (per_request + expected * pricing.completion)
        plan.worst_usd = rows * (per_request + length.max_tokens * pricing.completion)
        plan.worst_request_usd = worst_request_usd(pricing, length, mean_prompt)
        if account is not None and account.balance_usd is not None:
            plan.fit_in_flight = fit_in_flight(account.balance_usd, plan.worst_request_usd) or None
    elif pricing is not None:
        plan.expected_usd = plan.worst_usd = 0.0
    return plan


@dataclass(frozen=True)
class ByteShape:
    """A dataset file's lines, bytes, and longest line a run may send (not over ``max_line_bytes``)."""

    lines: int
    bytes: int
    longest: int


def byte_shape(path: Path, max_line_bytes: int) -> ByteShape:
    """One pass over raw bytes, no JSON parsed: ~1 s per GB, against minutes for the counts. A
    compressed, Parquet or arrow dataset is measured row by row as its JSON lines would be."""
    if not is_plain_jsonl(path):
        rows = total = longest = 0
        for size in row_sizes(path, max_line_bytes):
            rows, total = rows + 1, total + size + 1
            if size <= max_line_bytes:
                longest = max(longest, size)
        return ByteShape(rows, total, longest)
    lines = total = longest = 0
    current = 0  # bytes of the line under way, across chunks
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(_SCAN_CHUNK_BYTES), b""):
            total += len(chunk)
            parts = chunk.split(b"\n")
            current += len(parts[0])
            if len(parts) == 1:
                continue
            for size in (current, *map(len, parts[1:-1])):
                lines += 1
                if size <= max_line_bytes:
                    longest = max(longest, size)
            current = len(parts[-1])
    if current:
        lines += 1
        if current <= max_line_bytes:
            longest = max(longest, current)
    return ByteShape(lines, total, longest)


def clears_by_bytes(cfg: RunConfig, info: ModelInfo | None, *, yes: bool,
                    account: Account | None = None) -> str | None:
    """Why the counts cannot refuse this run, from the files' bytes alone; None when they might.

    A byte-level BPE token is at least one byte of the text it encodes, and a prompt's text is its
    line's strings plus what the template adds, the row's structure it renders again included
    (``common/prompt_tokens.tokens_bound``). So no prompt can be too long when the longest line,
    bounded so, fits the room ``max_tokens`` leaves in the context, and the worst case cannot exceed
    ``[run] budget_usd`` (nor what the key can spend) when it does not with every prompt that long
    (or the files' bytes, whichever is less). Then requests need not wait for the counts, which
    still run and are printed; should they refuse all the same, the run stops as a refusal does (a
    worker refuses a prompt that cannot fit by itself, before its request)."""
    context = cfg.model.context_length or (info.context_length if info else None)
    pricing = cfg.model.pricing or (info.pricing if info else None)
    confirmed = yes or cfg.run.confirm_over_budget
    budget = None if confirmed else cfg.run.budget_usd
    spendable = None if confirmed or account is None else account.spendable_usd
    worst_usd = 0.0
    longest_tokens = 0
    for ds in cfg.datasets:
        shape = byte_shape(ds.path, ds.max_line_bytes)
        length = cfg.length_for(ds.length)
        per_prompt = tokens_bound(shape.longest)
        longest_tokens = max(longest_tokens, per_prompt)
        if context is not None and per_prompt + length.max_tokens > context:
            return None
        if (budget is not None or spendable is not None) and pricing is not None:
            _, rows = _rows_to_budget(ds, length, shape.lines)
            prompt_tokens = min(rows * per_prompt, tokens_bound(shape.bytes, shape.lines))
            worst_usd += (prompt_tokens * pricing.prompt
                          + rows * (pricing.request + length.max_tokens * pricing.completion))
    if budget is not None and worst_usd > budget:
        return None
    if spendable is not None and pricing is not None and _run_worst(cfg, worst_usd) > spendable:
        return None
    fits = "any context" if context is None else f"the context of {context:,}"
    dollars = "" if budget is None else f"; worst case at most {_usd(worst_usd)} of budget_usd {_usd(budget)}"
    return f"every prompt has at most {longest_tokens:,} tokens, bounded by bytes, which fit {fits}{dollars}"


def _run_worst(cfg: RunConfig, worst_usd: float) -> float:
    """The most a run can spend: its worst case, or its dollar budget if that is less (a hard
    budget never passes it)."""
    budget = cfg.run.budget_usd
    return worst_usd if budget is None else min(worst_usd, budget)


def start_in_flight(cfg: RunConfig, info: ModelInfo | None, account: Account | None) -> int | None:
    """Where the fleet's balance bound starts: the worst-case requests the key can spend on (the
    balance or the key's limit left, the lower known), for the dataset whose requests weigh most,
    each prompt bounded from its file's bytes (requests may leave before the counts are in). None:
    a cap or a start is set, or both figures or the price are unknown. A bound in dollars only: the
    provider's capacity is learned apart (common/throttle.lua), so a large balance costs nothing."""
    pricing = cfg.model.pricing or (info.pricing if info else None)
    spendable = account.spendable_usd if account is not None else None
    if (cfg.request.max_in_flight is not None or cfg.request.start_in_flight is not None or pricing is None
            or spendable is None):
        return None
    worst = 0.0
    for ds in cfg.datasets:
        shape = byte_shape(ds.path, ds.max_line_bytes)
        mean_prompt = tokens_bound(shape.bytes, shape.lines) / shape.lines if shape.lines else 0.0
        worst = max(worst, worst_request_usd(pricing, cfg.length_for(ds.length), mean_prompt))
    return fit_in_flight(spendable, worst) or None


def apply_account(cfg: RunConfig, info: ModelInfo | None, account: Account | None) -> RunConfig:
    """The run file with the fleet's starting in-flight limit from the balance, where it is silent."""
    start = start_in_flight(cfg, info, account)
    if start is None:
        return cfg
    return cfg.model_copy(update={"request": cfg.request.model_copy(update={"start_in_flight": start})})


def read_model(cfg: RunConfig, base_url: str) -> tuple[ModelInfo | None, str | None]:
    """The plan's quick part: the model's entry (or why it is unknown). ``UnknownModel`` and a
    dollar budget with no price known propagate: nothing to plan, and no need for the tokenizer."""
    missing = [f"datasets[{i}] ({d.name}).path: {why}"
               for i, d in enumerate(cfg.datasets) if (why := dataset_problem(d.path))]
    if missing:
        raise PlanRefused("dataset files missing\n  " + "\n  ".join(missing))
    info: ModelInfo | None = None
    unavailable = None
    try:
        info = fetch_model(base_url, cfg.model.name)
    except ModelsUnavailable as exc:
        unavailable = str(exc)
    applied = apply_model(cfg, info)
    applied.require_prices()
    applied.require_batch_variant()  # batch mode with a model that has no :batch variant: before anything
    return info, unavailable


def count_plan(cfg: RunConfig, base_url: str, info: ModelInfo | None, unavailable: str | None, *,
               exact_limit: int = EXACT_LIMIT, account: Account | None = None) -> Plan:
    """The plan's slow part: the tokenizer (its import and load) and every dataset's count."""
    tokenizer = load_tokenizer(cfg.model.tokenizer, trust_remote_code=cfg.model.trust_remote_code,
                               revision=cfg.model.revision)
    prompt_filter = RunFilter(cfg)  # in config order: each dataset's duplicates of the ones before
    datasets = [plan_dataset(cfg, ds, tokenizer, info, exact_limit=exact_limit, account=account,
                             prompt_filter=prompt_filter) for ds in cfg.datasets]
    return Plan(
        model=cfg.model.name, url=Endpoints.of(base_url).models,
        context_length=cfg.model.context_length or (info.context_length if info else None),
        pricing=cfg.model.pricing or (info.pricing if info else None),
        datasets=datasets, unavailable=unavailable, account=account,
        start_in_flight=cfg.request.start_in_flight, max_in_flight=cfg.request.max_in_flight,
        distillable=info.distillable if info else None,
    )


def _usd(value: float | None) -> str:
    return "?" if value is None else f"${value:,.2f}"


def _per_mtok(value: float) -> str:
    return f"${value * 1e6:,.2f}/M"


def render(plan: Plan) -> str:
    lines = []
    if plan.unavailable:
        lines.append(f"model {plan.model}: price and context length unknown ({plan.unavailable})")
    else:
        price = (f"{_per_mtok(plan.pricing.prompt)} prompt · {_per_mtok(plan.pricing.completion)} completion"
                 f" · ${plan.pricing.request:g}/request") if plan.pricing else "price unknown"
        context = f"context {plan.context_length:,}" if plan.context_length else "context unknown"
        allowed = {True: "allowed", False: "not allowed", None: "not stated"}[plan.distillable]
        lines.append(f"model {plan.model} ({plan.url}): {context} · {price} · distillation {allowed}")
    header = ("dataset", "prompts", "prompt tok", "max tok", "expect tok", "rows to budget", "expected $",
              "worst $")
    rows = [header]
    for d in plan.datasets:
        rows.append((d.name, f"{d.prompts:,}", ("~" if d.sampled else "") + f"{d.prompt_tokens:,}",
                     f"{d.max_tokens:,}", f"{d.expected_completion:,}", f"{d.expected_rows:,}",
                     _usd(d.expected_usd), _usd(d.worst_usd)))
    rows.append(("total", f"{sum(d.prompts for d in plan.datasets):,}",
                 ("~" if any(d.sampled for d in plan.datasets) else "")
                 + f"{sum(d.prompt_tokens for d in plan.datasets):,}", "", "",
                 f"{sum(d.expected_rows for d in plan.datasets):,}",
                 _usd(plan.total("expected_usd")), _usd(plan.total("worst_usd"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                                  strict=True))))
    lines.append("expect tok: estimate_tokens of the length class, else max_tokens/4; expected $: the rows "
                 "to budget at that length; worst $: the same requests each answered with max_tokens")
    lines += _mode_lines(plan)
    lines += _left_out_lines(plan)
    if plan.account is not None:
        lines += _account_lines(plan, plan.account)
    for d in plan.datasets:
        if d.sampled:
            lines.append(f"{d.name}: prompt tokens extrapolated from a sample of {d.counted:,} of "
                         f"{d.prompts:,} prompts")
        if d.malformed:
            lines.append(f"{d.name}: {d.malformed:,} malformed or duplicate rows are skipped "
                         f"(`specfleet check` lists them)")
    return "\n".join(lines)


def _left_out_lines(plan: Plan) -> list[str]:
    """The duplicates not asked again (prompts and dollars saved), and the eval leaks left out."""
    out = []
    for d in plan.datasets:
        if d.duplicate_prompts:
            share = "" if not d.all_prompts_usd or d.saved_usd is None else \
                f" ({d.saved_usd / d.all_prompts_usd:.0%} of its {_usd(d.all_prompts_usd)})"
            out.append(f"{d.name}: saved {d.duplicate_prompts:,} of {d.prompts + d.duplicate_prompts:,} prompts, "
                       f"~{_usd(d.saved_usd)}{share}: the same as an earlier prompt of the run, not asked again")
        if d.excluded:
            out.append(f"{d.name}: {d.excluded:,} prompts share a run of words with an eval set ([run] exclude): "
                       f"not asked (excluded.jsonl)")
    duplicates = sum(d.duplicate_prompts for d in plan.datasets)
    if duplicates:
        saved, every = plan.total("saved_usd"), plan.total("all_prompts_usd")
        share = "" if not every or saved is None else f" ({saved / every:.0%} of {_usd(every)})"
        out.append(f"saved: {duplicates:,} duplicate prompts not asked, ~{_usd(saved)} expected{share}")
    return out


def _mode_lines(plan: Plan) -> list[str]:
    """Per dataset: live or batch, both prices and the saving (the $ columns are the mode's)."""
    out = []
    for d in plan.datasets:
        live, batch = d.live_expected_usd, d.batch_expected_usd
        saving = "" if live is None or batch is None or not live else \
            f", batch saves {_usd(live - batch)} ({1 - batch / live:.0%})"
        prices = f"expected live {_usd(live)}, batch {_usd(batch) if d.can_batch else 'n/a'}{saving}"
        if d.mode == "batch":
            out.append(f"{d.name}: batch mode (OpenRouter's Batch API, answers in minutes to hours) · {prices}")
        elif d.can_batch:
            out.append(f"{d.name}: live mode · {prices}: mode = \"batch\" (or \"auto\") can use the Batch API")
        else:
            out.append(f"{d.name}: live mode · {prices} · no batch variant for this model or dataset")
    return out


def _account_lines(plan: Plan, account: Account) -> list[str]:
    if account.balance_usd is not None:
        balance = f"balance {_usd(account.balance_usd)}"
    else:
        balance = f"balance unknown ({account.balance_unknown})"
    if not account.key_known:
        key = f"key limit unknown ({account.key_unknown})"
    elif account.key_limit_usd is None:
        key = "key limit none"
    else:
        key = f"key limit {_usd(account.key_limit_usd)}, {_usd(account.key_remaining_usd)} left"
    spendable = account.spendable_usd
    lines = [f"account: {balance} · {key} · the key can spend "
             f"{'?' if spendable is None else _usd(spendable)}"]
    fits = [d for d in plan.datasets if d.fit_in_flight is not None and d.worst_request_usd is not None]
    if fits:
        per = " · ".join(f"{d.name} {d.fit_in_flight:,} (${d.worst_request_usd:.4f} each)" for d in fits)
        if plan.max_in_flight is not None:
            start = f"[request] max_in_flight {plan.max_in_flight:,} caps the fleet"
        elif plan.start_in_flight is not None:
            start = f"the fleet's in-flight limit starts at {plan.start_in_flight:,}"
        else:
            start = "the fleet's in-flight limit starts unbounded"
        lines.append(f"in flight under the balance: {per} worst-case requests (prompt + max_tokens at the model's "
                     f"price; more are refused 402 in_flight_budget_exhausted, which slows the fleet); {start}")
    return lines


def problems(plan: Plan, cfg: RunConfig, *, yes: bool) -> list[str]:
    """What stops the run from starting, one line each."""
    out: list[str] = []
    for d in plan.datasets:
        out += [f"{d.name}: prompt_too_long: {row}" for row in d.too_long[:_MAX_NAMED_ROWS]]
        if len(d.too_long) > _MAX_NAMED_ROWS:
            out.append(f"{d.name}: … and {len(d.too_long) - _MAX_NAMED_ROWS:,} more prompts too long")
    # A dollar budget without a known price never gets here: read_model asks RunConfig.require_prices first.
    budget, worst = cfg.run.budget_usd, plan.total("worst_usd")
    if budget is not None and worst is not None and worst > budget and not (yes or cfg.run.confirm_over_budget):
        out.append(f"worst case {_usd(worst)} exceeds [run] budget_usd {_usd(budget)}: the run may stop on "
                   f"its dollar budget; pass --yes (or set [run] confirm_over_budget = true) to start anyway")
    spendable = plan.account.spendable_usd if plan.account is not None else None
    if (spendable is not None and worst is not None and _run_worst(cfg, worst) > spendable
            and not (yes or cfg.run.confirm_over_budget)):
        out.append(f"worst case {_usd(_run_worst(cfg, worst))} exceeds what the key can spend ({_usd(spendable)}: "
                   f"the balance and the key's limit left): the account may refuse the run part-way (402, the "
                   f"fleet halts); pass --yes (or set [run] confirm_over_budget = true) to start anyway")
    return out


def apply_model(cfg: RunConfig, info: ModelInfo | None) -> RunConfig:
    """The run file with what the models endpoint said, where the file is silent: context length
    and prices, for the worker view."""
    update: dict[str, object] = {}
    if info is not None and cfg.model.context_length is None and info.context_length is not None:
        update["context_length"] = info.context_length
    if info is not None and cfg.model.pricing is None and info.pricing is not None:
        update["pricing"] = info.pricing
    if info is not None and cfg.model.batch_pricing is None and info.batch_pricing is not None:
        update["batch_pricing"] = info.batch_pricing
    return cfg.model_copy(update={"model": cfg.model.model_copy(update=update)}) if update else cfg


#: Counts the plan; calls its argument with why, if the byte bound clears the run first.
Counting = Callable[[Callable[[str], None]], tuple["Plan", list[str]]]


class PendingPlan:
    """The plan's slow part (the tokenizer's import and load, and the counts: ~1.7 s of CPU before
    the first request of a run), counting while the run queues its first prompts and workers take
    and prepare them. Until the plan clears the run, nothing is sent: the run holds the fleet-wide
    throttle (``FleetThrottle.reset(hold=True)``) and this lifts it (``on_clear``) the moment either
    the bound from the files' bytes shows the counts cannot refuse (``clears_by_bytes``: at once,
    for most runs) or the counts pass. A refusal leaves the hold in place: the runner stops the
    run's datasets, and the prompts workers hold end without a request.

    The counting runs in a forked process when this one has no other thread yet (the CLI, at its
    start): on a core of its own, instead of sharing this process's interpreter lock with the run's
    start-up and first enqueue. Otherwise (forking a process with threads can inherit a lock another
    thread held) in a thread of this process.

    Once the byte bound has cleared the run, the counts gate nothing but the printed table, so they
    wait for ``start_counts`` (the runner calls it when the first wave has left) or ``settle``, or
    ``COUNTS_WAIT_MAX_S``: counted beside the first wave, they took a core's share of the 2-core
    box's ramp (the tokenizer's import alone is ~1.6 s of CPU).
    """

    def __init__(self, cfg: RunConfig, base_url: str, info: ModelInfo | None, unavailable: str | None, *,
                 yes: bool, account: Account | None = None, endpoints: ModelEndpoints | None = None) -> None:
        self._cfg, self._base_url, self._info, self._unavailable, self._yes = cfg, base_url, info, unavailable, yes
        self._account = account
        #: The model's endpoints (``producer/providers.py``), printed after the plan's table.
        self._endpoints = endpoints
        self._lock = threading.Lock()
        self._on_clear: list[Callable[[], None]] = []
        self._cleared = False
        #: Why requests started before the counts were in (the byte bound), if they did.
        self.cleared_early: str | None = None
        self._done = threading.Event()
        self._plan: Plan | None = None
        self._problems: list[str] = []
        self._error: BaseException | None = None
        fork = _may_fork()
        #: Set when counts held back by the byte bound may start (shared with a forked child).
        self._go: Any = multiprocessing.get_context("fork").Event() if fork else threading.Event()
        counting = self._fork() if fork else self._count_here
        threading.Thread(target=self._run, args=(counting,), name="plan", daemon=True).start()

    def _count_here(self, cleared: Callable[[str], None]) -> tuple[Plan, list[str]]:
        why = clears_by_bytes(self._cfg, self._info, yes=self._yes, account=self._account)
        if why is not None:
            cleared(why)
            self._go.wait(COUNTS_WAIT_MAX_S)
        plan = count_plan(self._cfg, self._base_url, self._info, self._unavailable, account=self._account)
        return plan, problems(plan, self._cfg, yes=self._yes)

    def _fork(self) -> Counting:
        """Start the count in a child now (from this, the only thread); the result, when called."""
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_count_in_child, args=(send, self._count_here), name="specfleet-plan", daemon=True)
        child.start()
        send.close()

        def result(cleared: Callable[[str], None]) -> tuple[Plan, list[str]]:
            try:
                while (message := receive.recv())[0] == "cleared":
                    cleared(message[1])
            except EOFError:
                child.join()
                raise SpecfleetError(
                    f"the plan's counting process ended without an answer (exit {child.exitcode})") from None
            child.join()
            kind, *payload = message
            if kind == "error":
                raise payload[0]
            return payload[0], payload[1]

        return result

    def _run(self, counting: Counting) -> None:
        try:
            self._plan, self._problems = counting(self._clear_early)
        except BaseException as exc:  # raised in the caller's thread by settle()
            self._error = exc
            self._done.set()
            return
        self._done.set()
        if not self._problems:
            self._clear()

    def _clear_early(self, why: str) -> None:
        self.cleared_early = why
        self._clear()

    def _clear(self) -> None:
        with self._lock:
            if self._cleared:
                return
            self._cleared = True
            callbacks, self._on_clear = self._on_clear, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # the runner lifts the hold again once it sees the plan passed
                log.warning("after the plan cleared the run: %s: %s", type(exc).__name__, exc)

    def on_clear(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when requests may start (now, if they may)."""
        with self._lock:
            if not self._cleared:
                self._on_clear.append(callback)
                return
        callback()

    def awaiting_start(self) -> bool:
        """The byte bound cleared the run and the counts have not been told to start."""
        return self.cleared_early is not None and not self._go.is_set()

    def start_counts(self) -> None:
        """Let counts held back by the byte bound start now."""
        self._go.set()

    def cleared(self) -> bool:
        """Requests may start: the byte bound showed the counts cannot refuse, or they passed."""
        return self._cleared

    def done(self) -> bool:
        return self._done.is_set()

    def settle(self, out: TextIO | None = None) -> Plan:
        """Wait for the counts, print the plan (to stdout by default, as it is when called: live
        progress bars redirect it above themselves); ``PlanRefused`` (or the count's own error) if
        the run must not start, or go on."""
        self._go.set()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._plan is not None
        print(render(self._plan), file=out or sys.stdout, flush=True)
        if self._endpoints is not None:
            print(self._endpoints.render(), file=out or sys.stdout, flush=True)
        if self._problems:
            raise PlanRefused("refusing to start:\n  " + "\n  ".join(self._problems))
        return self._plan


def _may_fork() -> bool:
    return threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods()


def _count_in_child(send: Any, count: Counting) -> None:
    def cleared(why: str) -> None:
        send.send(("cleared", why))
        # The counts gate nothing now but the printed plan: the workers' first wave comes first.
        os.nice(5)

    try:
        plan, found = count(cleared)
        send.send(("ok", plan, found))
    except BaseException as exc:
        try:
            send.send(("error", exc))
        except Exception:  # an error that does not pickle: its words still reach the run
            send.send(("error", SpecfleetError(f"{type(exc).__name__}: {exc}")))


def start_plan(cfg: RunConfig, base_url: str, *, yes: bool,
               api_key: str | None = None) -> tuple[RunConfig, PendingPlan]:
    """The model's entry and the account now (an unknown model is refused before anything else), the
    counts to come: the run file with the model's context length and prices and the fleet's starting
    in-flight limit, and the plan still counting. ``api_key``: the key the account is read with
    (None: the account is not asked)."""
    info, unavailable = read_model(cfg, base_url)
    # Before the account or anything else is asked: a model not licensed to distill is refused here.
    cfg = cfg.with_distillation(read_permission(cfg, info, base_url))
    account = fetch_account(base_url, api_key) if api_key else None
    cfg = apply_account(cfg, info, account)
    cfg, endpoints = apply_endpoints(cfg, base_url)
    return apply_model(cfg, info), PendingPlan(cfg, base_url, info, unavailable, yes=yes, account=account,
                                               endpoints=endpoints)


def check_plan(cfg: RunConfig, base_url: str, *, yes: bool, out: TextIO | None = None,
               api_key: str | None = None) -> RunConfig:
    """Plan, print it, refuse with ``PlanRefused`` if the run must not start; else the run file with
    the model's context length and prices filled in."""
    applied, pending = start_plan(cfg, base_url, yes=yes, api_key=api_key)
    pending.settle(out)
    return applied
