"""The TOML run file: what to generate, from which data, under which budget.

Validated on load with pydantic; every error names the file, the field path and, where it can be
found, the line (``fleet.toml:14: datasets[1].length: Input should be 'short' or 'long'``).
Relative paths are resolved against the run file's folder, so a config runs from any cwd.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from common.datasets import DEFAULT_MAX_LINE_BYTES
from common.errors import ConfigError

DEFAULT_BUDGET_TOKENS = 10_000_000
_DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: Who answers: OpenRouter (text only), or a self-hosted OpenAI-compatible engine that returns the
#: token ids it sampled (vLLM's and SGLang's ``return_token_ids``, llama.cpp's ``return_tokens``), at the
#: workers' ``SPECFLEET_ENGINE_URL``.
UpstreamKind = Literal["openrouter", "vllm", "sglang", "llamacpp"]
#: ``[model] usage_check``: what an answer billed with other token counts than the fleet's does.
UsageCheck = Literal["halt", "flag", "off"]
#: ``[model] engine_prompt_mismatch``: what an engine's differently rendered prompt does to the run.
EnginePromptMismatch = Literal["refuse", "warn"]


class Pricing(_Strict):
    """The model's price in USD, OpenRouter's ``pricing`` shape: per token, and per request."""

    prompt: float = Field(ge=0)
    completion: float = Field(ge=0)
    request: float = Field(default=0.0, ge=0)


class UsageOffset(_Strict):
    """``[model] usage_offset``: billed minus counted tokens expected of every answer."""

    prompt: int = 0
    completion: int = 0


class ModelConfig(_Strict):
    #: What the upstream is asked for (OpenRouter's model id, or the engine's served model name).
    name: str = Field(min_length=1)
    upstream: UpstreamKind = "openrouter"
    #: HF hub id or local folder, loaded with AutoTokenizer.
    tokenizer: str = Field(min_length=1)
    trust_remote_code: bool = False
    revision: str | None = None
    #: Tokens the model takes in and gives out together; a prompt whose ids plus ``max_tokens``
    #: exceed it is refused before it is sent. None: unknown, not checked (read from OpenRouter's
    #: models endpoint at run start when the run file does not say).
    context_length: int | None = Field(default=None, gt=0)
    #: The price that dollar budgets use for worst-case holds. Stated here, it overrides what the
    #: models endpoint says; absent, it is read from there at run start.
    pricing: Pricing | None = None
    #: The price of the model's Batch API variant (``<name>:batch`` in the models list): what a batch
    #: request's worst case is held at and its row costs. Absent: read from the models endpoint; a
    #: model without one cannot run in batch mode (``RunConfig.require_batch_variant``).
    batch_pricing: Pricing | None = None
    #: Provider name -> the quantization it serves the model at (``fp8``, ``bf16`` …), as the
    #: endpoints API lists them; read from it at run start when the run file does not say. Rows name
    #: their provider; this names the weights behind it (``row["quantization"]``, the manifest).
    quantizations: dict[str, str] | None = None
    #: Engine runs: an answer whose prompt ids differ from the prompt the run's tokenizer renders
    #: (the engine serves another chat template) halts the run at the first one (``refuse``), or is
    #: kept and counted, the summary and report warning per dataset (``warn``).
    engine_prompt_mismatch: EnginePromptMismatch = "refuse"
    #: Billed usage minus the fleet's own counts (prompt ids; completion ids with the end-of-turn
    #: token it appends) that every answer should show: ``completion = -1`` for a server that does
    #: not count the end token, ``prompt = 1`` for one that adds a BOS. Absent: learned, the most
    #: common difference of the first ``usage_check_answers`` (common/usage_check.py).
    usage_offset: UsageOffset | None = None
    #: An answer whose billed usage differs otherwise: its row is flagged (``usage_check``) and, past
    #: ``usage_mismatch_max`` of the first ``usage_check_answers``, the run halts (``halt``); only
    #: flagged and counted (``flag``); not compared (``off``).
    usage_check: UsageCheck = "halt"
    #: 200: enough answers that a few odd ones (a provider's hiccup) stay under the limit, few
    #: enough that a wrong tokenizer costs at most that many answers before the halt (it halts as
    #: soon as the limit is passed: at the 11th disagreeing answer by default).
    usage_check_answers: int = Field(default=200, gt=0)
    usage_mismatch_max: float = Field(default=0.05, ge=0, le=1)
    #: Go on with a model whose author does not allow its outputs to train other models (the models
    #: list's ``is_trainable_text`` false), and send requests without
    #: ``provider.enforce_distillable_text``. False: such a model is refused before any request, and
    #: every request carries the flag (OpenRouter then routes only to models that allow distillation).
    allow_non_distillable: bool = False


class LengthClass(_Strict):
    max_tokens: int = Field(gt=0)
    #: Read timeout of one HTTP attempt: the only real time limit under gevent.
    timeout_s: float = Field(gt=0)
    #: ``budget_mode = "projected"`` only: tokens a request is expected to keep, before kept rows
    #: give a measured mean. Default: max_tokens, which can't overshoot the budget in the first
    #: wave; a lower guess admits more requests at the start but overshoots if it is wrong. The
    #: hard rule always holds max_tokens (common/budget.py BudgetPolicy).
    estimate_tokens: int | None = Field(default=None, gt=0)
    #: A prompt longer than this (counted with the target tokenizer) is refused before it is sent,
    #: failed as ``prompt_too_long``. None: only the model's context length limits it.
    max_prompt_tokens: int | None = Field(default=None, gt=0)


#: How requests go out: one HTTP call each (``live``), in Batch API batches (``batch``: about half
#: the price, answers in minutes to hours), or ``auto``: batch where the model has a batch variant.
RequestMode = Literal["live", "batch", "auto"]
#: The Batch API's limits per batch (shared/reference/openrouter.md "Batch API").
BATCH_MAX_REQUESTS = 5_000
BATCH_MAX_BYTES = 200 * 1024 * 1024
#: What a batch-mode dataset does once the room its budget has left is less than a full batch's
#: worst cases (``batch_size`` x the worst case): the rounds would only shrink from there (each
#: admits what the room allows and gets back a fraction of it), one batch latency each.
#: ``live``: the rest goes as live requests, at the live price (at most a full batch's worst cases
#: of tokens); ``batch``: rounds of ever smaller batches until less than one worst case is left;
#: ``stop``: admission ends there, up to a full batch's worst cases short.
BatchTail = Literal["live", "batch", "stop"]

LengthName = Literal["short", "long"]
#: Where rows cut by max_tokens go (``RequestConfig.truncated``).
TruncatedPolicy = Literal["keep", "separate", "drop"]
#: Which assistant turns of a dataset row the target produces again (``DatasetConfig.regenerate``).
Regenerate = Literal["last", "all"]
_LENGTHS: tuple[LengthName, ...] = ("short", "long")


def _default_lengths() -> dict[LengthName, LengthClass]:
    return {
        "short": LengthClass(max_tokens=8_192, timeout_s=600),
        "long": LengthClass(max_tokens=32_768, timeout_s=3_600),
    }


class Distillation(_Strict):
    """A model's distillation permission as read from the models list (``is_trainable_text``)."""

    model: str
    #: None: the list did not say (or could not be read).
    is_trainable_text: bool | None
    read_at: str
    source: str


class ThrottleLimits(_Strict):
    """Fleet-wide caps on upstream requests (``common/throttle.py``), held in Redis for every worker
    of every host. None: no fixed cap; the adaptive limit that 429s cut applies either way."""

    max_in_flight: int | None = Field(default=None, gt=0)
    max_requests_per_s: float | None = Field(default=None, gt=0)
    #: Back off together: 429/503s above the provider's background share cut the fleet's in-flight
    #: limit and their Retry-After pauses every worker (``common/throttle.lua``). Off: a 429 is
    #: counted and delays only its own request; the caps apply either way.
    adaptive_backoff: bool = True
    #: Where the adaptive limit starts (None: unbounded, or at ``max_in_flight``). The plan sets it,
    #: when no ``max_in_flight`` is given, to the worst-case requests the account's balance covers.
    start_in_flight: int | None = Field(default=None, gt=0)


class RequestConfig(_Strict):
    """Passed through to OpenRouter's chat completions body (see shared openrouter.md), except the
    fleet's throttle settings ``max_in_flight``, ``max_requests_per_s`` and ``adaptive_backoff``, which
    stay in specfleet."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    #: OpenRouter ``reasoning``: {effort = "high"} or {max_tokens = N}, exclude, enabled.
    reasoning: dict[str, Any] | None = None
    #: OpenRouter ``provider`` routing: order, allow_fallbacks, require_parameters, data_collection…
    provider: dict[str, Any] | None = None
    #: ``route``: OpenRouter routes as ``provider`` says (rows report the mix). ``pin``: one provider
    #: only (``provider.only`` + ``allow_fallbacks = false``), ``provider_pin`` or the plan's choice
    #: (the cheapest endpoint); an answer from any other provider is refused (``provider_refused``).
    providers: Literal["route", "pin"] = "route"
    provider_pin: str | None = Field(default=None, min_length=1)
    #: Rows cut by max_tokens (``finish_reason = "length"``): ``keep`` in the shards, ``separate``
    #: in ``<dataset>/truncated.jsonl`` (full rows), ``drop`` (a stub per row in dropped.jsonl). The
    #: budget counts them as before either way: billed is billed, kept tokens are kept.
    truncated: TruncatedPolicy = "separate"
    #: Rows marked degenerate (``quality``: a looping answer, empty content after reasoning, reasoning
    #: never closed; common/quality.py): ``keep`` in the shards, ``separate`` in
    #: ``<dataset>/degenerate.jsonl``, ``drop`` (a stub in dropped.jsonl). Billed and counted as
    #: ``truncated`` rows are: the budget counts their tokens as kept either way.
    degenerate: TruncatedPolicy = "separate"
    #: Any other body keys, sent as they are (e.g. ``transforms``).
    extra: dict[str, Any] = Field(default_factory=dict)
    #: Requests the whole fleet may have in flight / start per second (``ThrottleLimits``).
    max_in_flight: int | None = Field(default=None, gt=0)
    max_requests_per_s: float | None = Field(default=None, gt=0)
    #: Congestion 429/503s cut the fleet's in-flight limit and pause every worker (``ThrottleLimits``).
    adaptive_backoff: bool = True
    #: Where the fleet's adaptive in-flight limit starts (``ThrottleLimits``); the plan fills it in.
    start_in_flight: int | None = Field(default=None, gt=0)

    #: ``live`` | ``batch`` | ``auto`` for every dataset that does not set its own ``mode``.
    mode: RequestMode = "live"
    #: Batch mode: requests per batch (a worker submits what it gathered sooner, see ``batch_gather_s``).
    batch_size: int = Field(default=1_000, gt=0, le=BATCH_MAX_REQUESTS)
    #: Batch mode: a worker submits what it gathered once the oldest request waited this long.
    batch_gather_s: float = Field(default=5.0, gt=0)
    #: Batch mode: how often an open batch's status is asked for.
    batch_poll_s: float = Field(default=30.0, gt=0)
    #: Batch mode: the budget's tail (``BatchTail``). ``live`` by default: a few requests at twice
    #: the price, instead of a round per batch latency (minutes to hours each) for each shrinking batch.
    tail: BatchTail = "live"

    def body(self) -> dict[str, Any]:
        exclude = {"extra", "providers", "provider_pin", "truncated", "degenerate", *_BATCH_FIELDS,
                   *ThrottleLimits.model_fields}
        out = {k: v for k, v in self.model_dump(exclude=exclude).items() if v is not None}
        out.update(self.extra)
        if self.providers == "pin" and self.provider_pin:
            out["provider"] = {**(self.provider or {}), "only": [self.provider_pin], "allow_fallbacks": False}
        return out

    def throttle(self) -> ThrottleLimits:
        return ThrottleLimits(max_in_flight=self.max_in_flight, max_requests_per_s=self.max_requests_per_s,
                              adaptive_backoff=self.adaptive_backoff, start_in_flight=self.start_in_flight)


_BATCH_FIELDS = ("mode", "batch_size", "batch_gather_s", "batch_poll_s", "tail")


class TokenizerPin(_Strict):
    """The tokenizer a run's rows are made with, as its workers receive it (common/tokenizer_pin.py)."""

    #: File name -> sha256 hex: the run manifest's ``tokenizer.files``.
    files: dict[str, str]
    chat_template_sha256: str | None
    #: The files' content address in Redis (``keys.tokenizer_files``); None: not handed over (too
    #: large), each worker loads its own copy.
    handoff: str | None = None


class BatchView(_Strict):
    """What a worker needs to run a dataset's prompts through the Batch API."""

    #: Datasets whose prompts go in batches (``mode`` batch, or auto with a batch variant).
    datasets: tuple[str, ...]
    pricing: Pricing | None
    size: int
    gather_s: float
    poll_s: float
    tail: BatchTail = "live"


class SamplingRecipe(_Strict):
    """One recipe of a dataset's ``sampling`` mixture: the sampling parameters its share of prompts
    is asked with (over ``[request]``'s), chosen per prompt by a stable hash of its id."""

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    share: float = Field(gt=0, le=1)
    #: What rows, the report and ``specfleet export --recipe`` call it (default: its parameters,
    #: ``temperature=0.8,top_p=0.95``).
    name: str | None = Field(default=None, min_length=1)

    def params(self) -> dict[str, Any]:
        """The body keys it sets."""
        return self.model_dump(exclude={"share", "name"}, exclude_none=True)

    def label(self) -> str:
        return self.name or ",".join(f"{k}={v:g}" for k, v in self.params().items()) or "default"


class RetryConfig(_Strict):
    max_attempts: int = Field(default=6, ge=1)
    backoff_base_s: float = Field(default=1.0, gt=0)
    backoff_max_s: float = Field(default=60.0, gt=0)
    #: A prompt the account keeps refusing for its in-flight budget (402 in_flight_budget_exhausted,
    #: no attempt spent) fails as ``in_flight_budget_exhausted`` once it has waited this long since
    #: the first refusal (another spender holding the balance): the next run asks it again.
    in_flight_wait_max_s: float = Field(default=1800.0, gt=0)


class OutputConfig(_Strict):
    dir: Path = Path("out")
    #: A shard is closed after this many rows; shards are what a trainer reads in parallel.
    shard_rows: int = Field(default=10_000, gt=0)


class DatasetConfig(_Strict):
    name: str
    path: Path
    length: Literal["short", "long"] = "short"
    budget_tokens: int = Field(default=DEFAULT_BUDGET_TOKENS, gt=0)
    #: Spend at most this many USD on the dataset (billed answers, kept or not). None: no limit.
    budget_usd: float | None = Field(default=None, gt=0)
    #: Take at most this many prompts from the file (None: all).
    max_prompts: int | None = Field(default=None, gt=0)
    #: A longer line is reported as ``line_too_long`` in malformed.jsonl and never sent.
    max_line_bytes: int = Field(default=DEFAULT_MAX_LINE_BYTES, gt=0)
    #: ``last``: the answer to the conversation's last non-assistant message is produced again (one
    #: row per prompt). ``all``: every assistant turn is, in order, each call seeing the regenerated
    #: history (one row per turn; see workers/pipeline/conversation.py).
    regenerate: Regenerate = "last"
    #: ``live`` | ``batch`` | ``auto`` for this dataset (None: ``[request] mode``).
    mode: RequestMode | None = None
    #: A mixture of sampling recipes (shares summing to 1): each prompt is asked with the recipe a
    #: stable hash of its id picks (``common/sampling.py``), the same on every rerun; its row names it.
    sampling: list[SamplingRecipe] | None = Field(default=None, min_length=1)

    @field_validator("name")
    @classmethod
    def _name_is_a_key(cls, v: str) -> str:
        if not _DATASET_NAME.match(v):
            raise ValueError("use letters, digits, '_', '-', '.' (it names a queue and a folder)")
        return v

    @field_validator("sampling")
    @classmethod
    def _shares_make_one(cls, v: list[SamplingRecipe] | None) -> list[SamplingRecipe] | None:
        if v is None:
            return v
        total = sum(r.share for r in v)
        if abs(total - 1) > 1e-6:
            raise ValueError(f"the recipes' shares sum to {total:g}, not 1")
        labels = [r.label() for r in v]
        if len(set(labels)) != len(labels):
            raise ValueError(f"two recipes share a name: {', '.join(labels)} (give each a name)")
        return v


class RunSection(_Strict):
    """``[run]``: limits across all datasets of the run."""

    #: Spend at most this many USD across every dataset of the run; the datasets after the one
    #: that reaches it are skipped (end reason ``run_budget``). None: no limit.
    budget_usd: float | None = Field(default=None, gt=0)
    #: Start even when ``specfleet plan``'s worst case exceeds ``budget_usd`` (same as ``--yes``).
    confirm_over_budget: bool = False
    #: ``hard``: the kept tokens and the dollars spent never exceed their budgets (requests near
    #: the end hold their worst case). ``projected``: tokens are admitted on an estimate, which
    #: can end slightly over or under (dollars always hold worst cases).
    budget_mode: Literal["hard", "projected"] = "hard"
    #: A prompt the same as an earlier one of the run (normalised: common/dedup.py), in any dataset,
    #: is not asked again. ``share``: its dataset gets the first one's row (``shared.jsonl``, marked
    #: ``duplicate_of``), paid by the first one's dataset; ``skip``: it is only counted; ``ask``: no
    #: dedup. ``share`` by default: every dataset keeps every row it asked for, nothing paid twice.
    duplicates: Literal["share", "skip", "ask"] = "share"
    #: Evaluation prompt sets (paths or globs, any form a dataset takes): a prompt that shares a run of
    #: ``exclude_ngram`` words with one is never asked (``excluded.jsonl``; common/decontam.py).
    exclude: list[str] = Field(default_factory=list)
    exclude_ngram: int = Field(default=13, gt=0)


class WorkerView(_Strict):
    """A worker's view of a run, as the producer stores it (``keys.config``) and workers load it
    (``WorkerView.model_validate_json``). Typed, so a renamed field fails mypy and validation, not
    a task deep in a run."""

    model: ModelConfig
    #: The OpenRouter body keys of ``[request]`` (``RequestConfig.body``), passed through.
    request: dict[str, Any]
    lengths: dict[LengthName, LengthClass]
    retry: RetryConfig
    #: Dataset name -> its length class.
    datasets: dict[str, LengthName]
    #: ``[request] max_in_flight`` / ``max_requests_per_s``: the fleet-wide caps of the throttle.
    throttle: ThrottleLimits = ThrottleLimits()
    #: Datasets whose every assistant turn is regenerated (``regenerate = "all"``); absent: "last".
    regenerate: dict[str, Regenerate] = Field(default_factory=dict)
    #: The run manifest's id (``common/manifest.py``), stamped on every row as ``manifest``.
    manifest: str = ""
    #: The manifest's tokenizer file and template hashes, and the key of the files in Redis: what a
    #: worker checks (and loads) before it takes a prompt (common/tokenizer_pin.py). Not part of
    #: ``config_id``, as ``manifest`` is not. None: a producer from before the pin (nothing checked).
    tokenizer_pin: TokenizerPin | None = None
    #: ``[request] providers = "pin"``: the one provider whose answers are kept; another's answer is
    #: refused (``provider_refused``). None: any provider.
    provider_pin: str | None = None
    #: The Batch API datasets and their settings (None: every dataset is live).
    batch: BatchView | None = None
    #: Dataset -> its sampling mixture (``DatasetConfig.sampling``); absent: ``request`` as it is.
    sampling: dict[str, list[SamplingRecipe]] = Field(default_factory=dict)

    def batched(self, dataset: str) -> bool:
        return self.batch is not None and dataset in self.batch.datasets

    def regenerates_all(self, dataset: str) -> bool:
        return self.regenerate.get(dataset, "last") == "all"

    def length(self, dataset: str) -> LengthClass:
        name = self.datasets.get(dataset)
        if name is None:
            raise ConfigError(f"this run has no dataset {dataset!r}")
        return self.lengths[name]


class RunConfig(_Strict):
    model: ModelConfig
    run: RunSection = RunSection()
    request: RequestConfig = RequestConfig()
    lengths: dict[LengthName, LengthClass] = Field(default_factory=_default_lengths)
    retry: RetryConfig = RetryConfig()
    output: OutputConfig = OutputConfig()
    datasets: list[DatasetConfig] = Field(min_length=1)
    #: The model's distillation permission as the plan read it from the models list (not a run file
    #: key: ``producer/plan.py`` sets it), for the manifest; None: not read.
    _distillation: Distillation | None = PrivateAttr(default=None)

    @property
    def distillation(self) -> Distillation | None:
        return self._distillation

    def with_distillation(self, read: Distillation) -> RunConfig:
        out = self.model_copy()
        out._distillation = read
        return out

    def enforces_distillable(self) -> bool:
        """Requests carry ``provider.enforce_distillable_text``: OpenRouter's routing flag, unless
        the owner went on with a model that does not allow distillation."""
        return self.model.upstream == "openrouter" and not self.model.allow_non_distillable

    def request_body(self) -> dict[str, Any]:
        """``[request]``'s body keys with the distillation routing flag in ``provider``."""
        body = self.request.body()
        if self.enforces_distillable():
            body["provider"] = {**(body.get("provider") or {}), "enforce_distillable_text": True}
        return body

    @field_validator("lengths", mode="before")
    @classmethod
    def _lengths_over_defaults(cls, given: Any) -> Any:
        """A ``[lengths.short]`` that sets only ``max_tokens`` keeps the other keys' defaults."""
        if not isinstance(given, dict):
            return given
        defaults = _default_lengths()
        return {name: {**defaults[name].model_dump(exclude_none=True), **keys}
                if name in defaults and isinstance(keys, dict) else keys for name, keys in given.items()}

    @model_validator(mode="after")
    def _unique_names_and_both_lengths(self) -> RunConfig:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"dataset names must be unique, repeated: {', '.join(dupes)}")
        asked = (self.request.provider or {}).get("enforce_distillable_text")
        if asked is not None and asked != (not self.model.allow_non_distillable):
            raise ValueError("[request.provider] enforce_distillable_text contradicts [model] "
                             "allow_non_distillable: set only allow_non_distillable (it decides the flag)")
        return self

    def worker_view(self, manifest: str = "", tokenizer_pin: TokenizerPin | None = None) -> WorkerView:
        """What workers need: no dataset paths, no output dir, no secrets. ``manifest``: the run
        manifest's id, ``tokenizer_pin`` its tokenizer's hashes (neither is part of ``config_id``: the
        manifest's identity includes this view's)."""
        return WorkerView(
            manifest=manifest,
            tokenizer_pin=tokenizer_pin,
            provider_pin=self.request.provider_pin if self.request.providers == "pin" else None,
            model=self.model,
            request=self.request_body(),
            lengths={k: self.length_for(k) for k in _LENGTHS},
            retry=self.retry,
            datasets={d.name: d.length for d in self.datasets},
            regenerate={d.name: d.regenerate for d in self.datasets if d.regenerate != "last"},
            throttle=self.request.throttle(),
            batch=self.batch_view(),
            sampling={d.name: d.sampling for d in self.datasets if d.sampling},
        )

    def asked_mode(self, dataset: DatasetConfig) -> RequestMode:
        return dataset.mode or self.request.mode

    def dataset_mode(self, dataset: DatasetConfig) -> Literal["live", "batch"]:
        """``auto`` resolved: batch where the model has a batch variant (a known batch price) and the
        dataset asks one answer per prompt (``regenerate = "all"`` needs each turn before the next)."""
        mode = self.asked_mode(dataset)
        if mode == "auto":
            return "batch" if self.model.batch_pricing is not None and dataset.regenerate == "last" else "live"
        return mode

    def batch_view(self) -> BatchView | None:
        names = tuple(d.name for d in self.datasets if self.dataset_mode(d) == "batch")
        if not names:
            return None
        r = self.request
        return BatchView(datasets=names, pricing=self.model.batch_pricing, size=r.batch_size,
                         gather_s=r.batch_gather_s, poll_s=r.batch_poll_s, tail=r.tail)

    def require_batch_variant(self) -> None:
        """Batch mode needs the model's ``:batch`` variant (its price) and one answer per prompt:
        refused before anything is sent, naming the datasets."""
        batch = [(i, d) for i, d in enumerate(self.datasets) if self.dataset_mode(d) == "batch"]
        turns = [f"datasets[{i}] ({d.name})" for i, d in batch if d.regenerate != "last"]
        if turns:
            raise ConfigError(f"{', '.join(turns)}: mode = \"batch\" cannot regenerate = \"all\" (each turn needs "
                              "the answer before it); use mode = \"live\" or \"auto\"")
        if batch and self.model.batch_pricing is None:
            names = ", ".join(f"datasets[{i}] ({d.name})" for i, d in batch)
            raise ConfigError(f"{names}: batch mode, but model {self.model.name!r} has no :batch variant "
                              "(no batch price in the models list or in [model.batch_pricing]): use "
                              "mode = \"live\" or \"auto\"")

    def require_prices(self) -> None:
        """A dollar budget needs the model's price (config or models endpoint) before any request."""
        with_usd = [f"datasets[{i}] ({d.name}).budget_usd" for i, d in enumerate(self.datasets) if d.budget_usd]
        if self.run.budget_usd:
            with_usd.insert(0, "[run] budget_usd")
        if with_usd and self.model.pricing is None:
            raise ConfigError(
                f"{', '.join(with_usd)} needs the price of model {self.model.name!r}, which is unknown: "
                "state it as [model.pricing] prompt = …, completion = … (USD per token, request = USD "
                "per request), or let specfleet read it from OpenRouter's models endpoint")

    def length_for(self, name: LengthName) -> LengthClass:
        return self.lengths.get(name) or _default_lengths()[name]

    def config_id(self) -> str:
        view = self.worker_view().model_dump(mode="json", exclude={"tokenizer_pin"})
        canonical = json.dumps(view, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _line_of(text: str, loc: tuple[int | str, ...]) -> int | None:
    """Best-effort line of a field path like ('datasets', 1, 'length'): tomllib keeps no positions."""
    lines = text.splitlines()
    start, end = 0, len(lines)
    path = list(loc)
    if len(path) >= 2 and isinstance(path[1], int):
        headers = [i for i, ln in enumerate(lines) if ln.strip() == f"[[{path[0]}]]"]
        if path[1] < len(headers):
            start = headers[path[1]]
            later = [i for i, ln in enumerate(lines) if i > start and ln.strip().startswith("[")]
            end = later[0] if later else len(lines)
        path = path[2:]
    elif path and isinstance(path[0], str):
        # A sub-table of its own ([model.pricing]) before its parent ([model]).
        depth = 2 if len(path) >= 2 and isinstance(path[1], str) and f"[{path[0]}.{path[1]}]" in (
            ln.strip() for ln in lines) else 1
        header = ".".join(str(p) for p in path[:depth])
        for i, ln in enumerate(lines):
            if ln.strip() in (f"[{header}]", f"[[{header}]]"):
                start = i
                break
        path = path[depth:]
    key = next((p for p in path if isinstance(p, str)), None)
    if key is None:
        return start + 1 if start else None
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start, end):
        if pattern.match(lines[i]):
            return i + 1
    return start + 1 if start else None


def _fmt_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read run file: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            line = _line_of(text, loc)
            where = f"{path}:{line}" if line else str(path)
            problems.append(f"{where}: {_fmt_loc(loc)}: {err['msg']}")
        raise ConfigError("invalid run file\n  " + "\n  ".join(problems)) from None
    return _resolve_paths(cfg, path.resolve().parent)


def _resolve_paths(cfg: RunConfig, base: Path) -> RunConfig:
    datasets = [d.model_copy(update={"path": (base / d.path).resolve()}) for d in cfg.datasets]
    output = cfg.output.model_copy(update={"dir": (base / cfg.output.dir).resolve()})
    run = cfg.run.model_copy(update={"exclude": [str(base / p) for p in cfg.run.exclude]})
    model = cfg.model
    local_tokenizer = base / model.tokenizer
    if local_tokenizer.is_dir():
        model = model.model_copy(update={"tokenizer": str(local_tokenizer.resolve())})
    return cfg.model_copy(update={"datasets": datasets, "output": output, "model": model, "run": run})
