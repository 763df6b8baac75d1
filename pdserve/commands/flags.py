"""argparse flags generated from the settings of the config dataclasses, and back again.

`add_flags` gives every `setting(...)` field of a config dataclass its flag (name, help with the
default, choices, parse and checks from the field); `add_pool_flags` gives each per-pool setting
its `--prefill-`/`--decode-` variant with the same parse and checks; `from_args` builds the
dataclass from the parsed namespace and `pool_overrides` collects one pool's variants. A bad value
is an argparse error naming the flag, before anything slow is imported. No torch here.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING
from typing import Any, TypeVar

from pdserve.config.settings import Option, options, pool_options

T = TypeVar("T")
POOLS = ("prefill", "decode")
Groups = dict[str, Any]  # --help section title -> argparse argument group


def add_flags(parser: argparse.ArgumentParser, cls: type, group: str, groups: Groups) -> None:
    """One flag per setting of `cls`, in `group` unless the setting names its own section.
    `groups` holds the sections made so far, so that several dataclasses can share them."""
    for opt in options(cls):
        title = opt.setting.group or group
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        groups[title].add_argument(opt.flag, dest=opt.name, **_argument(opt))


def add_pool_flags(group: Any, cls: type) -> None:
    """`--prefill-FLAG` and `--decode-FLAG` for every per-pool setting of `cls` (default: unset)."""
    for pool in POOLS:
        for opt in pool_options(cls):
            group.add_argument(
                f"--{pool}-{opt.flag[2:]}",
                dest=_pool_dest(pool, opt),
                type=_converter(opt),
                metavar=_metavar(opt),
                help=f"{pool} pool only: {opt.flag}",
            )


def from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The dataclass from its flags; `given` sets fields that no flag of `cls` sets directly."""
    values = {opt.name: getattr(args, opt.name) for opt in options(cls)}
    return cls(**{**values, **given})


def pool_overrides(cls: type, args: argparse.Namespace, pool: str) -> dict[str, Any]:
    """The per-pool settings of `cls` given for `pool`, by field name."""
    found = {opt.name: getattr(args, _pool_dest(pool, opt)) for opt in pool_options(cls)}
    return {name: value for name, value in found.items() if value is not None}


def _argument(opt: Option) -> dict[str, Any]:
    kw: dict[str, Any] = {"help": _help(opt).replace("%", "%%")}
    if opt.kind is bool:
        if opt.default is True and not opt.flag.startswith("--no-"):
            raise TypeError(f"setting {opt.name} is on by default: its flag must be --no-...")
        # off by default: --FLAG and --no-FLAG (a profile may turn it on, a flag off again)
        kw["action"] = "store_false" if opt.default else argparse.BooleanOptionalAction
        kw["default"] = opt.default
        return kw
    if opt.default is MISSING:
        kw["required"] = True
    else:
        kw["default"] = list(opt.default) if opt.kind is tuple else opt.default
    if opt.kind is tuple:
        kw["action"] = "append"
    kw["type"] = _converter(opt)
    kw["metavar"] = _metavar(opt)
    if opt.choices:
        kw["choices"] = opt.choices
    return kw


def _help(opt: Option) -> str:
    shown = opt.default not in (MISSING, None) and opt.kind not in (bool, tuple)
    suffix = f" (default: {opt.setting.show(opt.default)})" if shown else ""
    return opt.setting.help + suffix


def _metavar(opt: Option) -> str | None:
    if opt.choices:
        return None  # argparse shows {a,b,c}
    return opt.setting.metavar or opt.flag[2:].upper().replace("-", "_")


def _converter(opt: Option):
    """argparse `type=`: parse the text, then the setting's own checks (an item of a repeated
    flag is only parsed; the dataclass checks the whole list)."""

    def convert(text: str) -> Any:
        try:
            value = opt.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {e}") from None
        why = None if opt.kind is tuple else opt.problem(value)
        if why is not None:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: {why}")
        return value

    return convert


def _pool_dest(pool: str, opt: Option) -> str:
    return f"{pool}_{opt.name}"
