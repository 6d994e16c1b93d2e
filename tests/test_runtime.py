"""Fenced patches (workers/runtime/, common/runtime.py): every patched function's source is the one
verified, a worker on a library whose patched function changed refuses to start with one line, and
installing twice changes nothing."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import kombu
import kombu.transport.redis as kombu_redis_transport
import pytest
import redis.utils

from common.errors import PatchDrift
from common.runtime import Patch, check, fingerprint_source, refusal
from tests.fleet import REPO, Fleet
from workers import runtime

_FRESH = """
import json
from common.runtime import fingerprint, resolve
import workers.runtime as r
print(json.dumps({p.target: fingerprint(resolve(p.target)) for p in r.PATCHES}))
"""


@pytest.fixture(scope="module")
def installed() -> dict[str, str]:
    """Each target's fingerprint in a fresh interpreter, where nothing is patched yet."""
    out = subprocess.run([sys.executable, "-c", _FRESH], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("patch", runtime.PATCHES, ids=[p.name for p in runtime.PATCHES])
def test_every_patched_function_is_the_one_verified(patch: Patch, installed: dict[str, str]) -> None:
    # make test-latest runs this on the newest versions: an upstream change is this test, named.
    assert installed[patch.target] == patch.fingerprint, refusal(patch, installed[patch.target])


def test_every_patch_says_why_where_it_was_filed_and_what_it_was_verified_on() -> None:
    assert len({p.target for p in runtime.PATCHES}) == len(runtime.PATCHES)
    for p in runtime.PATCHES:
        assert p.why and len(p.reason) > len(p.why) and p.upstream and p.verified[0].isdigit(), p.name
        assert p.upstream == "none filed" or "https://github.com/" in p.upstream, p.name


def test_a_drifted_patch_is_refused_in_one_line_naming_the_package_its_version_and_the_patch() -> None:
    real = next(p for p in runtime.PATCHES if p.name == "kombu.transport.redis.Channel._brpop_read")
    stale = Patch(**{**real.__dict__, "fingerprint": "0" * 64})
    with pytest.raises(PatchDrift) as err:
        check([stale])
    line = str(err.value)
    assert "\n" not in line and err.value.dist == "kombu" and err.value.patch == real.name
    assert line == (f"kombu {kombu.__version__} changed kombu.transport.redis.Channel._brpop_read, which specfleet "
                    f"patches ({real.why}); verified on kombu 5.7.0 (fingerprint 000000000000…, now "
                    f"{real.fingerprint[:12]}…). Pin kombu==5.7.0 or upgrade specfleet.")


def test_install_twice_patches_once_and_does_not_refuse_its_own_replacements() -> None:
    runtime.install()
    runtime.install()  # the targets are specfleet's functions now: the check remembers the originals
    assert kombu_redis_transport.Channel._brpop_read is runtime.kombu_redis._brpop_read
    assert kombu_redis_transport.QoS.ack is runtime.kombu_redis._qos_ack
    assert redis.utils.get_lib_version is runtime.common_runtime._cached_lib_version
    assert not hasattr(redis.utils.get_lib_version, "__wrapped__") or not hasattr(
        redis.utils.get_lib_version.__wrapped__, "__wrapped__")  # cached once, not a cache of a cache


def _kombu_with_one_line_changed(root: Path) -> str:
    """A copy of the installed kombu, first on PYTHONPATH, with one line of ``Channel._brpop_read``
    changed; the fingerprint its source has now."""
    copy = root / "kombu"
    shutil.copytree(Path(kombu.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    module = copy / "transport" / "redis.py"
    lines = module.read_text().splitlines(keepends=True)
    source, first = inspect.getsourcelines(runtime.kombu_redis._ORIGINAL_BRPOP_READ)  # kombu's, patched or not
    at = first - 1 + next(i for i, line in enumerate(source) if "rsplit(self.sep, 1)[0]" in line)
    assert "rsplit(self.sep, 1)[0]" in lines[at]
    lines[at] = lines[at].replace("rsplit(self.sep, 1)[0]", "rsplit(self.sep, 2)[0]")
    module.write_text("".join(lines))
    edited = list(source)
    edited[at - (first - 1)] = lines[at]
    return fingerprint_source("".join(edited))


def test_a_worker_on_a_kombu_whose_patched_function_changed_refuses_to_start_in_one_line(
        fleet: Fleet, tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    now = _kombu_with_one_line_changed(site)
    proc = fleet.start_worker("w1", PYTHONPATH=str(site))
    deadline = time.monotonic() + 120  # a slow shared box; it ends at the app's import
    while proc.poll() is None:
        assert time.monotonic() < deadline, fleet.log("w1")
        time.sleep(0.2)
    log = fleet.log("w1")
    print(log)
    real = next(p for p in runtime.PATCHES if p.name == "kombu.transport.redis.Channel._brpop_read")
    expected = (f"specfleet worker: refusing to start: kombu {kombu.__version__} changed "
                f"kombu.transport.redis.Channel._brpop_read, which specfleet patches ({real.why}); verified on "
                f"kombu 5.7.0 (fingerprint {real.fingerprint[:12]}…, now {now[:12]}…). "
                f"Pin kombu==5.7.0 or upgrade specfleet.")
    assert proc.returncode == runtime.EXIT_PATCH_DRIFT, log
    assert log.strip().splitlines() == [expected], log
    assert "ready." not in log
