"""``python -m simulator [flags]``: run the OpenRouter simulator until SIGINT/SIGTERM.

Every setting is a flag (``--latency-median-ms 200``); ``--config FILE`` takes a JSON object in the
``POST /_sim/config`` format (flags win over it); ``--fault 429=0.05`` sets one rate in ``rates``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any

from simulator.run import serve
from simulator.settings import SettingsError, SimSettings, settings_fields

_COMPOUND = ("rates", "length_classes")  # set with --fault / --config, not one flag each


def _none_or(kind: type) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null", "") else kind(text)
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="JSON settings (as POST /_sim/config)")
    parser.add_argument("--fault", action="append", default=[], metavar="NAME=RATE",
                        help="a fault rate, e.g. 429=0.05 (repeatable)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    for f, hint in settings_fields():
        if f.name in _COMPOUND:
            continue
        flag = "--" + f.name.replace("_", "-")
        optional = type(None) in typing.get_args(hint)  # "X | None"
        base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
        default = f.default
        text = f"{f.metadata['help']} (default: {default!r})"
        if base is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        elif typing.get_origin(base) is tuple:
            parser.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, help=text,
                                type=lambda v: [p.strip() for p in v.split(",") if p.strip()])
        else:
            kind = base if base in (int, float, str) else str
            parse = _none_or(kind) if optional else kind
            parser.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, type=parse,
                                help=text, choices=f.metadata["choices"] or None)
    return parser


def settings_from_args(argv: Sequence[str] | None = None) -> tuple[SimSettings, str]:
    ns = build_parser().parse_args(argv)
    patch: dict[str, Any] = {}
    if ns.config:
        with open(ns.config, encoding="utf-8") as fh:
            patch.update(json.load(fh))
    for f, _ in settings_fields():
        # Flags default to SUPPRESS, so only those given are set ("--retry-after-s none" too).
        if f.name not in _COMPOUND and hasattr(ns, f.name):
            patch[f.name] = getattr(ns, f.name)
    rates = dict(patch.get("rates") or {})
    for item in ns.fault:
        name, sep, rate = item.partition("=")
        if not sep:
            raise SettingsError(f"--fault {item}: expected NAME=RATE")
        try:
            rates[name] = float(rate)
        except ValueError:
            raise SettingsError(f"--fault {item}: rate is not a number") from None
    if rates:
        patch["rates"] = rates
    return SimSettings().updated(patch, allow_fixed=True), ns.log_level


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, level = settings_from_args(argv)
    except (SettingsError, OSError, ValueError) as exc:
        print(f"simulator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(settings)
    except OSError as exc:  # port in use, bad tokenizer path
        print(f"simulator: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
