"""One tokenizer per run, on every host.

The run manifest (common/manifest.py) records the sha256 of each tokenizer file and of the chat
template, as the producer found them. ``TokenizerPin`` (common/config.py) carries those hashes to the workers in the
run's ``WorkerView``, so a worker checks the folder it is about to load against them and refuses
the run, naming the file that differs, before it takes a prompt: rows stamped with the run's
manifest are then made by the manifest's tokenizer, whatever that host's copy holds.

The producer also hands the files themselves over through Redis (``keys.tokenizer_files``, one hash
per set of files, content-addressed: they are small, a few MB at most). A worker writes them once
per host to a cache folder named by that hash and loads from there, so a worker on another host
needs only ``REDIS_URL`` (and the key), not the producer's path. ``SPECFLEET_TOKENIZER_FROM=local``
makes a worker load ``[model] tokenizer`` as its own host sees it instead, still checked.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common import keys
from common.config import TokenizerPin
from common.errors import ConfigError, TokenizerError
from common.manifest import chat_template_text, resolve_tokenizer, template_sha256, tokenizer_files

if TYPE_CHECKING:
    import redis

    from common.manifest import Manifest

log = logging.getLogger(__name__)

#: Files larger than this together are not handed over (workers load their own copy, checked):
#: Redis holds the run's queue window too. Qwen3's tokenizer.json is 11 MB, a tiktoken vocabulary 3 MB.
MAX_HANDOFF_BYTES = 64 << 20
#: A run's files stay in Redis this long after the start of the last run that put them (a worker
#: joining a week-long run late still finds them; a resumed run puts them again).
HANDOFF_TTL_S = 7 * 86_400
#: Hex digits of a hash a refusal shows.
SHORT_HEX = 12
_HANDOFF_HEX = 16


def handoff_id(files: dict[str, str]) -> str:
    """The content address of a set of tokenizer files: the sha256 of their names and hashes."""
    canonical = json.dumps(dict(sorted(files.items())), separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:_HANDOFF_HEX]


def _short(sha: str | None) -> str:
    return "absent" if sha is None else sha[:SHORT_HEX]


def publish(client: redis.Redis, manifest: Manifest) -> TokenizerPin:
    """Put the manifest's tokenizer files in Redis; the pin the workers get.

    The bytes put are checked against the manifest's hashes: a file edited since the manifest was
    built fails the start, naming it, rather than handing over files no manifest describes."""
    files = manifest.tokenizer.files
    folder, _ = resolve_tokenizer(manifest.tokenizer.source, manifest.tokenizer.revision)
    pin = TokenizerPin(files=files, chat_template_sha256=manifest.chat_template_sha256)
    size = sum((folder / name).stat().st_size for name in files)
    if not files or size > MAX_HANDOFF_BYTES:
        log.warning("tokenizer files are %.1f MB, over the %d MB handed to workers through Redis: each worker "
                    "loads [model] tokenizer from its own host (checked against the manifest)",
                    size / 1e6, MAX_HANDOFF_BYTES >> 20)
        return pin
    blobs: dict[str, bytes] = {}
    for name, sha in files.items():
        data = (folder / name).read_bytes()
        now = hashlib.sha256(data).hexdigest()
        if now != sha:
            raise ConfigError(f"{folder / name}: changed while the run started (hashed {_short(sha)}, now "
                              f"{_short(now)}): start the run again")
        blobs[name] = data
    handoff = handoff_id(files)
    key = keys.tokenizer_files(handoff)
    pipe = client.pipeline(transaction=True)
    pipe.hset(key, mapping=blobs)
    pipe.expire(key, HANDOFF_TTL_S)
    pipe.execute()
    return pin.model_copy(update={"handoff": handoff})


def check(folder: Path, pin: TokenizerPin) -> None:
    """Refuse (``TokenizerError``, one line) a folder whose files or template are not the pin's."""
    here = tokenizer_files(folder) if folder.is_dir() else {}
    for name in sorted(pin.files.keys() | here.keys()):
        want, got = pin.files.get(name), here.get(name)
        if want != got:
            raise TokenizerError(f"tokenizer file {name} in {folder} is not the run manifest's: here {_short(got)}, "
                                 f"manifest {_short(want)}")
    template = template_sha256(chat_template_text(folder))
    if template != pin.chat_template_sha256:
        raise TokenizerError(f"the chat template in {folder} is not the run manifest's: here {_short(template)}, "
                             f"manifest {_short(pin.chat_template_sha256)}")


def _install(staging: Path, folder: Path, pin: TokenizerPin) -> None:
    """Rename ``staging`` into ``folder``. A folder another process put there first is kept, never
    removed: processes (or containers sharing the cache) may be loading it at this moment, and a
    removal under them reads as "file absent" (it refused a run once, two replicas on one cache).
    Only a folder that fails the check is moved aside, by rename, so no reader sees it half gone."""
    for _ in range(3):
        try:
            os.rename(staging, folder)
            return
        except OSError:
            if not folder.is_dir():
                raise
        try:
            check(folder, pin)
            return  # another process's rename won the race: its folder is as good
        except TokenizerError:
            damaged = folder.with_name(f".{folder.name}-damaged-{os.getpid()}-{time.monotonic_ns()}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(folder, damaged)
            shutil.rmtree(damaged, ignore_errors=True)
    raise TokenizerError(f"could not put the run's tokenizer in {folder}: it kept changing under this worker")


def fetch(client: redis.Redis, pin: TokenizerPin, cache_dir: Path) -> Path | None:
    """The pin's files in a local folder (``cache_dir/<handoff>``), written from Redis once per host
    and checked; None where Redis no longer has them (expired)."""
    assert pin.handoff is not None
    folder = cache_dir / pin.handoff
    try:
        check(folder, pin)
        return folder
    except TokenizerError:
        pass  # not there yet (or damaged): written again from Redis
    blobs = client.hgetall(keys.tokenizer_files(pin.handoff))
    if not blobs:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Written beside its place and renamed into it: processes of one host fetching at once never
    # see a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{pin.handoff}-", dir=cache_dir))
    staging.chmod(0o755)  # mkdtemp's 0700 would keep the folder from the host's other users' workers
    try:
        for raw_name, data in blobs.items():
            name = raw_name.decode()
            if name not in pin.files or Path(name).name != name:
                raise TokenizerError(f"{keys.tokenizer_files(pin.handoff)} holds {name!r}, no file of the run's "
                                     "tokenizer")
            (staging / name).write_bytes(data)
        check(staging, pin)
        _install(staging, folder, pin)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    check(folder, pin)
    return folder


__all__ = ["HANDOFF_TTL_S", "MAX_HANDOFF_BYTES", "TokenizerPin", "check", "fetch", "handoff_id", "publish"]
