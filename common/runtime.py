"""Fenced patches: what specfleet changes in other libraries' private code, and the guard.

A patch of a private method is correct only for the source it was written against. Each one is
declared as a ``Patch``: what it targets, why, the upstream issue, the version it was verified on
and the sha256 of the target's source there (``fingerprint``). ``check`` compares every declared
fingerprint with the installed library before anything is patched; one that differs raises
``PatchDrift``, and a worker refuses to start (one line: the package, its version, the patch)
instead of running on code nobody tested. A library upgrade that leaves the patched functions as
they were passes.

The worker's patches are in ``workers/runtime/`` (``workers.runtime.PATCHES`` is the whole list);
redis-py's, which every process uses, are here (``PATCHES``), installed by
``common/redis_client.py`` before its first client.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import redis.utils

from common.errors import PatchDrift


@dataclass(frozen=True)
class Patch:
    """One change to (or reliance on) another library's private code."""

    #: ``module:qualname`` of the function whose source the patch was written against.
    target: str
    #: The distribution that ships it (for its version and the pin to suggest).
    dist: str
    #: The version the patch was verified on (the one uv.lock installs).
    verified: str
    #: sha256 of the target's normalised source on ``verified`` (``fingerprint``).
    fingerprint: str
    #: A few words for the refusal line.
    why: str
    #: The whole reason, as the code needs it.
    reason: str
    #: The upstream issue or pull request, or "none filed".
    upstream: str
    #: ``module:name`` of what replaces the target; "" when specfleet's code only relies on it
    #: (a subclass overriding it, or a caller of a private method).
    replacement: str = ""

    @property
    def name(self) -> str:
        return self.target.replace(":", ".")


def fingerprint(obj: Any) -> str:
    """sha256 of ``obj``'s source, dedented, trailing whitespace stripped from every line."""
    return fingerprint_source(inspect.getsource(obj))


def fingerprint_source(source: str) -> str:
    text = textwrap.dedent(source)
    return hashlib.sha256("\n".join(line.rstrip() for line in text.splitlines()).encode()).hexdigest()


def resolve(dotted: str) -> Any:
    module, _, qualname = dotted.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


#: The target's fingerprint as first seen in this process, before any patch replaced it (a second
#: ``install`` would otherwise fingerprint specfleet's own replacement).
_seen: dict[str, str] = {}


def current_fingerprint(patch: Patch) -> str:
    found = _seen.get(patch.target)
    if found is None:
        found = _seen[patch.target] = fingerprint(resolve(patch.target))
    return found


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def refusal(patch: Patch, now: str, more: int = 0) -> str:
    """The one line a process refusing to run on an unverified target says (``PatchDrift``)."""
    verb = "patches" if patch.replacement else "relies on"
    also = f" ({more} more patch{'es' if more > 1 else ''} changed too)" if more else ""
    return (f"{patch.dist} {version_of(patch.dist)} changed {patch.name}, which specfleet {verb} ({patch.why}); "
            f"verified on {patch.dist} {patch.verified} (fingerprint {patch.fingerprint[:12]}…, now {now[:12]}…)."
            f"{also} Pin {patch.dist}=={patch.verified} or upgrade specfleet.")


def check(patches: Iterable[Patch]) -> None:
    """Raise ``PatchDrift`` naming the first patch whose target's source is not the verified one."""
    drifted = [(p, now) for p in patches if (now := current_fingerprint(p)) != p.fingerprint]
    if drifted:
        patch, now = drifted[0]
        raise PatchDrift(refusal(patch, now, len(drifted) - 1), patch=patch.name, dist=patch.dist)


# --- redis-py (every process) --------------------------------------------------------------------

PATCHES = (
    Patch(
        target="redis.utils:get_lib_version",
        dist="redis", verified="8.1.0",
        fingerprint="6babaa21b7b727521caa8a60d4436a11ea28175adb85bf3707a7194a8c061eb5",
        why="its answer read once per process",
        reason="redis-py reads its own version from the installed packages' metadata for every new "
               "connection (a scan of sys.path, ~1 ms); a worker opens a thousand at its ramp, kombu's pool as "
               "many. The answer cannot change while the process runs: ask once (functools.cache).",
        upstream="none filed",
        replacement="common.runtime:_cached_lib_version"),
    Patch(
        target="redis.connection:AbstractConnection.connect_check_health",
        dist="redis", verified="8.1.0",
        fingerprint="af7fb5e25eed1109b3c0262c2dacac2a838110f75e4dae8b3f9de7754e11d635",
        why="common/redis_client.SentinelConnection overrides it to ask the Sentinels",
        reason="redis-py (8.1) asks the Sentinels for the master in SentinelManagedConnection.connect() only; a "
               "command sent on a disconnected connection (every pipeline, every retry of a command that met "
               "the old master's death) reconnects through connect_check_health, which retries the address the "
               "connection had: after a failover, the dead master's, for the whole retry window. "
               "common/redis_client.SentinelConnection overrides it, relying on what it does on 8.1.",
        upstream="none filed"),
    Patch(
        target="redis.client:Pipeline._execute_transaction",
        dist="redis", verified="8.1.0",
        fingerprint="16fe393a292434f46a992d21d318cace4a4d12ae5352f4d77197474f84366813",
        why="common/redis_client.FencedTransaction sends its fence after it, on its connection",
        reason="A fence (WAITAOF) queued inside MULTI aborts the whole transaction (EXECABORT) on servers "
               "without the command (Redis 6.2, 7.0). common/redis_client.FencedTransaction overrides "
               "_execute_transaction to send the fence after EXEC on the same connection, inside the same "
               "retry, relying on what it does on 8.1 (sends MULTI…EXEC, reads every reply, leaves the "
               "connection idle).",
        upstream="none filed"),
)

_cached_lib_version = functools.cache(redis.utils.get_lib_version)


def install() -> None:
    """redis-py's patches, once per process (raises ``PatchDrift`` before patching anything)."""
    check(PATCHES)
    if redis.utils.get_lib_version is not _cached_lib_version:
        redis.utils.get_lib_version = _cached_lib_version
