"""urllib3 pool internals ``workers/upstreams/openrouter.py``'s ``warm`` relies on (fenced: ``PATCHES``).

Nothing is replaced: ``OpenRouterClient.warm`` opens connections ahead of the first wave by
taking a ``None`` slot from the pool's LIFO queue, ``_new_conn`` and ``_put_conn``; a urllib3 that
changed those could leave the pool over its size or the warmed connections unused.
"""

from __future__ import annotations

from common.runtime import Patch, check

_WHY = "OpenRouterClient.warm opens connections into its idle slots"
_REASON = ("urllib3's HTTPConnectionPool starts its LIFO queue full of None (a slot for a connection not made yet); "
           "warm() removes one None, opens a connection with _new_conn and puts it back with _put_conn, so the "
           "pool never holds more than its size and the requests that follow pop the warmed ones first "
           "(1,000 requests in flight in 0.34-0.37 s from a warmed pool, 0.47-0.71 s from an empty one).")


def _urllib3(method: str, fingerprint: str) -> Patch:
    return Patch(target=f"urllib3.connectionpool:HTTPConnectionPool.{method}", dist="urllib3", verified="2.8.0",
                 fingerprint=fingerprint, why=_WHY, reason=_REASON, upstream="none filed")


PATCHES = (
    _urllib3("_new_conn", "a0af7799d96d4ee958e3729537ceba55265969be91ca087e29c189cc58de8d8c"),
    _urllib3("_get_conn", "4170e6463c68ffcc4eab9f1fd5d3a34f4c6af59aee3d8712ad14328acd97ae9e"),
    _urllib3("_put_conn", "1a11576b88765ca9d6ce8694f28d070eb527c41bd89d2131be9f082554690681"),
)


def install() -> None:
    check(PATCHES)
