"""The run manifest (``OUT/manifest.json``): what made the rows, so a folder can be audited, told
apart from another run's and rebuilt.

Its *identity* is what decides the rows' tokens and distribution: the model id, the sha256 of every
tokenizer file, the chat template's sha256, the request parameters (``max_tokens`` per length class
included) and the provider preferences with the providers policy. ``manifest_id`` is the first 12 hex
digits of the sha256 of that identity as canonical JSON; every row carries it (``row["manifest"]``,
stamped by the workers from ``WorkerView.manifest``), so rows of merged folders stay traceable.
Start and end times, budgets, counts and the truncation policy are not part of it: a resumed run of
the same configuration keeps its id, and its rows and the earlier ones name the same manifest.

Built by the producer before the first task (it hashes the tokenizer files it resolves, without
importing transformers), written again with the counts when the run ends. A folder whose
``manifest.json`` has another id (the configuration or the tokenizer changed) keeps the earlier one
as ``manifest-<id>.json`` beside it: the rows naming it are still described.

Readers (``specfleet validate``, ``specfleet export``) use ``read_manifest``/``read_manifests``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import RunConfig

MANIFEST = "manifest.json"
#: A replaced manifest of the same folder: ``manifest-<id>.json``.
OLD_MANIFEST = "manifest-{id}.json"
ID_HEX = 12
#: Files of a tokenizer folder (or hub snapshot) that take part in tokenizing and rendering:
#: everything but weights. Remote-code tokenizers (Kimi's ``tokenization_kimi.py``) count too.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".ckpt")
#: What a hub snapshot is asked for (the same files a folder is hashed by, without the weights).
HUB_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.py", "*.jinja", "*.vocab", "*.merges"]
_HASH_CHUNK = 1 << 20


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizerInfo(_Model):
    #: The run file's ``model.tokenizer``: a hub id or a folder.
    source: str
    #: The hub commit the files came from (a folder: the run file's ``model.revision``, or None).
    revision: str | None = None
    #: File name (relative to the tokenizer's folder) -> sha256 hex.
    files: dict[str, str] = Field(default_factory=dict)


class DatasetProvenance(_Model):
    budget_tokens: int
    budget_usd: float | None = None
    #: ``"<provider>|<quantization>"`` -> rows in the output (shards and truncated.jsonl); an unknown
    #: quantization is ``"?"``.
    providers: dict[str, int] = Field(default_factory=dict)
    #: Rows the output holds or dropped whose ``finish_reason`` is ``length``.
    truncated: int = 0
    #: Prompts of the file not asked: duplicates of an earlier prompt of the run, eval leaks
    #: (excluded.jsonl); rows given to duplicates from their first copy (shared.jsonl).
    duplicate_prompts: int = 0
    excluded: int = 0
    shared_rows: int = 0
    #: Rows marked degenerate by reason (``quality``), wherever ``[request] degenerate`` put them.
    degenerate: dict[str, int] = Field(default_factory=dict)
    #: Sampling recipe -> kept tokens (``[[datasets]] sampling``).
    recipe_tokens: dict[str, int] = Field(default_factory=dict)


class Manifest(_Model):
    manifest_id: str
    specfleet_version: str
    model: str
    tokenizer: TokenizerInfo
    chat_template_sha256: str | None
    #: The chat completions body's parameters (no secrets: no key is ever in the run file), with
    #: ``max_tokens`` per length class; provider routing is under ``provider``.
    request: dict[str, Any]
    #: OpenRouter ``provider`` preferences as sent (with ``providers = "pin"``: only + no fallbacks).
    provider: dict[str, Any] | None = None
    #: ``route`` (OpenRouter chooses) or ``pin`` (one provider; rows from any other refused).
    providers_policy: str = "route"
    #: ``keep`` | ``separate`` | ``drop``: where rows cut by max_tokens go.
    truncated_policy: str = "keep"
    #: ``keep`` | ``separate`` | ``drop``: where rows marked degenerate go (``[request] degenerate``).
    degenerate_policy: str = "keep"
    #: ``[run] duplicates`` (share | skip | ask), and the eval sets kept out (``[run] exclude``,
    #: matched on runs of ``exclude_ngram`` words).
    duplicates_policy: str = "share"
    exclude: list[str] = Field(default_factory=list)
    exclude_ngram: int = 13
    datasets: dict[str, DatasetProvenance] = Field(default_factory=dict)
    #: The model's distillation permission as read from the models list (``is_trainable_text``, when,
    #: where), whether the owner went on without it (``[model] allow_non_distillable``) and whether
    #: requests carried ``provider.enforce_distillable_text``. None: a manifest from before it.
    distillation: dict[str, Any] | None = None
    #: Dataset -> its sampling recipes (name -> parameters and share), as rows name them.
    sampling: dict[str, dict[str, dict[str, Any]]] = Field(default_factory=dict)
    started_at: str
    ended_at: str | None = None

    def identity(self) -> dict[str, Any]:
        return identity(self.model, self.tokenizer, self.chat_template_sha256, self.request, self.provider,
                        self.providers_policy)

    def dumps(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def identity(model: str, tokenizer: TokenizerInfo, template_sha256: str | None, request: dict[str, Any],
             provider: dict[str, Any] | None, providers_policy: str) -> dict[str, Any]:
    """What ``manifest_id`` hashes: what decides the rows' tokens and the weights behind them."""
    return {"model": model, "tokenizer_files": dict(sorted(tokenizer.files.items())),
            "chat_template_sha256": template_sha256, "request": request, "provider": provider,
            "providers_policy": providers_policy}


def manifest_id(ident: dict[str, Any]) -> str:
    canonical = json.dumps(ident, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:ID_HEX]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_files(folder: Path) -> dict[str, str]:
    """File name -> sha256 of a tokenizer folder's files but its weights: what a manifest records
    and a worker checks the folder it loads against (common/tokenizer_pin.py)."""
    out: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(WEIGHT_SUFFIXES):
            out[path.name] = sha256_file(path)
    return out


def resolve_tokenizer(source: str, revision: str | None) -> tuple[Path, TokenizerInfo]:
    """The tokenizer's folder and its files' hashes: a local folder as it is, a hub id through the
    hub's cache (``snapshot_download``: what the workers' ``from_pretrained`` reads too)."""
    folder = Path(source)
    if folder.is_dir():
        return folder, TokenizerInfo(source=source, revision=revision, files=tokenizer_files(folder))
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(source, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, no access: one kind of failure for the caller
        raise ConfigError(f"[model] tokenizer {source!r}: cannot resolve its files for the manifest: {exc}") from None
    return snapshot, TokenizerInfo(source=source, revision=snapshot.name, files=tokenizer_files(snapshot))


def chat_template_text(folder: Path) -> str | None:
    """The chat template as transformers loads it: ``chat_template.jinja``, else
    ``chat_template.json``'s, else ``tokenizer_config.json``'s ``chat_template`` (a list of named
    templates is kept as canonical JSON)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            continue
        if isinstance(template, str):
            return template
        if template is not None:
            return json.dumps(template, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return None


def template_sha256(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def specfleet_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specfleet")
    except PackageNotFoundError:
        return "unknown"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def build_manifest(*, model: str, tokenizer_source: str, revision: str | None, request: dict[str, Any],
                   provider: dict[str, Any] | None, providers_policy: str, truncated_policy: str,
                   budgets: Iterable[tuple[str, int, float | None]]) -> Manifest:
    """A run's manifest at its start: hashes computed, no counts yet. ``budgets``: (dataset,
    budget_tokens, budget_usd)."""
    folder, tok = resolve_tokenizer(tokenizer_source, revision)
    template = template_sha256(chat_template_text(folder))
    ident = identity(model, tok, template, request, provider, providers_policy)
    return Manifest(
        manifest_id=manifest_id(ident), specfleet_version=specfleet_version(), model=model, tokenizer=tok,
        chat_template_sha256=template, request=request, provider=provider, providers_policy=providers_policy,
        truncated_policy=truncated_policy,
        datasets={name: DatasetProvenance(budget_tokens=tokens, budget_usd=usd) for name, tokens, usd in budgets},
        started_at=now_iso(),
    )


def request_params(cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The request parameters a manifest records, and the provider preferences as sent: the
    chat completions body without ``provider``, with the upstream kind and ``max_tokens`` of each
    length class the datasets use."""
    body = cfg.request_body()
    provider = body.pop("provider", None)
    lengths = sorted({d.length for d in cfg.datasets})
    body["max_tokens"] = {name: cfg.length_for(name).max_tokens for name in lengths}
    body["upstream"] = cfg.model.upstream
    return body, provider


def manifest_for(cfg: RunConfig) -> Manifest:
    """The run's manifest at its start (``build_manifest`` with the run file's parts)."""
    request, provider = request_params(cfg)
    manifest = build_manifest(
        model=cfg.model.name, tokenizer_source=cfg.model.tokenizer, revision=cfg.model.revision, request=request,
        provider=provider, providers_policy=cfg.request.providers, truncated_policy=cfg.request.truncated,
        budgets=[(d.name, d.budget_tokens, d.budget_usd) for d in cfg.datasets])
    read = cfg.distillation
    distillation = {"model": cfg.model.name, "is_trainable_text": read.is_trainable_text if read else None,
                    "read_at": read.read_at if read else None, "source": read.source if read else None,
                    "allow_non_distillable": cfg.model.allow_non_distillable,
                    "enforce_distillable_text": cfg.enforces_distillable()}
    sampling = {d.name: {r.label(): {**r.params(), "share": r.share} for r in d.sampling}
                for d in cfg.datasets if d.sampling}
    return manifest.model_copy(update={"duplicates_policy": cfg.run.duplicates, "exclude": list(cfg.run.exclude),
                                       "exclude_ngram": cfg.run.exclude_ngram, "distillation": distillation,
                                       "degenerate_policy": cfg.request.degenerate,
                                       "sampling": sampling})


def read_manifest(path: Path) -> Manifest:
    """``path``: a manifest file, or an output folder (its ``manifest.json``)."""
    if path.is_dir():
        path = path / MANIFEST
    try:
        return Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the manifest: {exc.strerror or exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ConfigError(f"{path}: not a specfleet manifest: {where}: {first['msg']}") from None


def read_manifests(out_dir: Path) -> dict[str, Manifest]:
    """Every manifest of an output folder by id: ``manifest.json`` and the ones it replaced."""
    out: dict[str, Manifest] = {}
    for path in sorted(out_dir.glob("manifest*.json")):
        m = read_manifest(path)
        out[m.manifest_id] = m
    return out


def write_manifest(out_dir: Path, manifest: Manifest) -> Path:
    """``OUT/manifest.json``, atomically. The same id: ``started_at`` of the first run is kept
    (a resumed run goes on with it). Another id: the old file is kept as ``manifest-<id>.json``."""
    from common.files import atomic_write

    path = out_dir / MANIFEST
    if path.is_file():
        try:
            old = read_manifest(path)
        except ConfigError:
            old = None
        if old is not None and old.manifest_id == manifest.manifest_id:
            manifest = manifest.model_copy(update={"started_at": min(old.started_at, manifest.started_at)})
        elif old is not None:
            os.replace(path, out_dir / OLD_MANIFEST.format(id=old.manifest_id))
    atomic_write(path, manifest.dumps().encode())
    return path


__all__ = [
    "MANIFEST", "DatasetProvenance", "Manifest", "TokenizerInfo", "build_manifest", "chat_template_text",
    "identity", "manifest_for", "manifest_id", "read_manifest", "read_manifests", "request_params",
    "resolve_tokenizer", "sha256_file", "template_sha256", "tokenizer_files", "write_manifest",
]
