"""What ``REDIS_URL`` names: one Redis server, or a master behind Redis Sentinel.

The one parser every process reads the URL with (the budget's and the producer's clients, kombu's
broker, Flower, the exporter), so they cannot disagree on where the master is.

A plain URL is redis-py's (``redis://``, ``rediss://``, ``unix://``) and is passed on unchanged.
A Sentinel URL is the form Celery's broker takes, each Sentinel as its own ``sentinel://`` part
joined by ``;``, and the master's name as the ``master_name`` option Celery users put in
``broker_transport_options``::

    sentinel://:PASSWORD@s1:26379;sentinel://s2:26379;sentinel://s3:26379/0?master_name=mymaster

The password (and user) are the master's, as in kombu; ``sentinel_password`` is the Sentinels' own
(``requirepass`` in sentinel.conf), when they have one. The password, the database and the options
may stand on any part (kombu reads them from the first); given on two parts they must agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from common.errors import ConfigError

SENTINEL_SCHEME = "sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_SENTINEL_PORT = 26379
#: Options a Sentinel URL may carry; any other is a typo worth refusing.
SENTINEL_OPTIONS = ("master_name", "sentinel_password")
#: A Sentinel that does not answer is skipped for the next one: it must not hold a master lookup
#: for a command's whole socket timeout.
SENTINEL_SOCKET_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RedisTarget:
    """A parsed ``REDIS_URL``. ``sentinels`` is empty for a plain URL (then ``url`` is all there is)."""

    url: str = field(repr=False)
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)

    @property
    def is_sentinel(self) -> bool:
        return bool(self.sentinels)

    def broker_url(self) -> str:
        """The URL kombu's transport gets: the same server(s), without our options (kombu would
        take them for a virtual host)."""
        if not self.is_sentinel:
            return self.url
        auth = ""
        if self.username or self.password:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password or '', safe='')}@"
        parts = [f"{SENTINEL_SCHEME}://{auth if i == 0 else ''}{host}:{port}/{self.db}"
                 for i, (host, port) in enumerate(self.sentinels)]
        return ";".join(parts)

    def sentinel_kwargs(self) -> dict[str, Any]:
        """Connection options for the Sentinels themselves (redis-py's and kombu's ``sentinel_kwargs``)."""
        kwargs: dict[str, Any] = {"socket_timeout": SENTINEL_SOCKET_TIMEOUT_S,
                                  "socket_connect_timeout": SENTINEL_SOCKET_TIMEOUT_S}
        if self.sentinel_password:
            kwargs["password"] = self.sentinel_password
        return kwargs

    def transport_options(self) -> dict[str, Any]:
        """What kombu's Sentinel transport (and Flower's broker view) needs beyond the URL."""
        if not self.is_sentinel:
            return {}
        return {"master_name": self.master_name, "sentinel_kwargs": self.sentinel_kwargs()}

    def describe(self) -> str:
        """Where the URL points, without a password: ``host:port/db`` or the Sentinels and master."""
        if self.is_sentinel:
            hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
            return f"master {self.master_name!r} via Sentinel {hosts} db {self.db}"
        tail = self.url.split("@", 1)[-1]
        return tail.split("://", 1)[-1]


def parse(url: str, name: str = "REDIS_URL") -> RedisTarget:
    """``url`` as a ``RedisTarget``; a ``ConfigError`` naming ``name`` (and never the password)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme in PLAIN_SCHEMES:
        return RedisTarget(url=url)
    if scheme == "sentinels":
        raise ConfigError(f"{name}: sentinels:// (TLS) is not supported: kombu's Sentinel transport has no "
                          "TLS URL form; use sentinel:// on a trusted network")
    if scheme != SENTINEL_SCHEME:
        raise ConfigError(f"{name}: expected redis://, rediss://, unix:// or sentinel://host:26379;…"
                          f"?master_name=NAME, not {scheme + '://' if scheme else 'no scheme'}")
    sentinels: list[tuple[str, int]] = []
    found: dict[str, str] = {}

    def agree(key: str, value: str, part: int) -> None:
        if key in found and found[key] != value:
            shown = "the passwords differ" if "password" in key else f"{found[key]!r} and {value!r}"
            raise ConfigError(f"{name}: part {part} gives another {key} than an earlier part ({shown})")
        found[key] = value

    for number, part in enumerate(url.split(";"), start=1):
        if not part.startswith(f"{SENTINEL_SCHEME}://"):
            raise ConfigError(f"{name}: part {number} ({_hide(part)}) does not start with sentinel://; "
                              "Sentinels are joined by ';' each with its own sentinel://")
        split = urlsplit(part)
        try:
            host, port = split.hostname, split.port
        except ValueError:
            raise ConfigError(f"{name}: part {number} ({_hide(part)}): the port is not a number") from None
        if not host:
            raise ConfigError(f"{name}: part {number} ({_hide(part)}) names no Sentinel host")
        sentinels.append((host, port or DEFAULT_SENTINEL_PORT))
        if split.username:
            agree("username", unquote(split.username), number)
        if split.password is not None:
            agree("password", unquote(split.password), number)
        path = split.path.strip("/")
        if path:
            if not path.isdigit():
                raise ConfigError(f"{name}: part {number}: the database {path!r} is not a number")
            agree("db", str(int(path)), number)
        for key, values in parse_qs(split.query, keep_blank_values=True).items():
            if key not in SENTINEL_OPTIONS:
                raise ConfigError(f"{name}: unknown option {key!r} (a Sentinel URL takes "
                                  f"{', '.join(SENTINEL_OPTIONS)})")
            for value in values:
                agree(key, value, number)
    master = found.get("master_name")
    if not master:
        raise ConfigError(f"{name}: a sentinel:// URL needs the master's name, as Sentinel knows it "
                          "(sentinel monitor NAME …): add ?master_name=NAME")
    return RedisTarget(url=url, sentinels=tuple(sentinels), master_name=master, db=int(found.get("db", 0)),
                       username=found.get("username") or None, password=found.get("password") or None,
                       sentinel_password=found.get("sentinel_password") or None)


def _hide(part: str) -> str:
    """A URL part with its password replaced, for an error message."""
    head, sep, tail = part.rpartition("@")
    if not sep:
        return part
    scheme, _, auth = head.partition("://")
    user = auth.split(":", 1)[0]
    return f"{scheme}://{user}:***@{tail}"
