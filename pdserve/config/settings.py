"""The one table of user settings: each config field declares its flag, help and checks.

A field of a user-facing config dataclass is declared with `setting(...)` (a user sets it: default,
help, checks, flag name, per-pool variants) or `internal(...)` (derived or filled in by code, with
the reason). `pdserve.commands.flags` turns the settings into argparse flags, and the dataclass's
`__post_init__` calls `check_settings`, so the command line, `LLM(**kwargs)` and per-pool overrides
accept exactly the same values and report a bad one the same way. No torch here.
"""

from __future__ import annotations

import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

_KEY = "pdserve"  # the key of a field's metadata this module owns


@dataclass(frozen=True)
class Check:
    """One rule a value must follow; `why` completes "invalid name=value: ..."."""

    ok: Callable[[Any], bool]
    why: str


def at_least(low: int) -> Check:
    return Check(lambda v: v >= low, f"must be >= {low}")


def in_range(low: int, high: int) -> Check:
    return Check(lambda v: low <= v <= high, f"must be in [{low}, {high}]")


POSITIVE = Check(lambda v: v > 0, "must be > 0")
POWER_OF_TWO = Check(lambda v: v >= 1 and v & (v - 1) == 0, "must be a power of two")


@dataclass(frozen=True)
class Setting:
    """What the command line needs to know about one field (stored in the field's metadata)."""

    help: str
    flag: str | None = None  # without "--"; default: the field name with dashes
    parse: Callable[[str], Any] | None = None  # flag text -> value; default: the field's type
    choices: tuple[str, ...] = ()  # allowed values; an enum field takes its members
    checks: tuple[Check, ...] = ()
    metavar: str | None = None
    group: str | None = None  # the --help section; default: the one the command gives
    per_pool: bool = False  # also --prefill-FLAG and --decode-FLAG (disaggregated pools)
    show: Callable[[Any], str] = str  # how --help prints the default


@dataclass(frozen=True)
class Internal:
    """A field no flag sets; `why` says where its value comes from."""

    why: str


def setting(default: Any = MISSING, *, help: str, **cli: Any) -> Any:
    """A user-settable field (no default: a required flag). `cli` are `Setting`'s other fields."""
    return field(default=default, metadata={_KEY: Setting(help=help, **cli)})


def internal(*, why: str, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    return field(default=default, default_factory=default_factory, metadata={_KEY: Internal(why)})


@dataclass(frozen=True)
class Option:
    """One setting of one dataclass with its type resolved from the annotation."""

    name: str
    setting: Setting
    default: Any  # MISSING: required
    kind: type | None  # bool, int, float, str, tuple (of str) or an Enum; None: several types
    optional: bool  # None is a valid value

    @property
    def flag(self) -> str:
        return "--" + (self.setting.flag or self.name.replace("_", "-"))

    @property
    def enum_type(self) -> type[enum.Enum] | None:
        is_enum = isinstance(self.kind, type) and issubclass(self.kind, enum.Enum)
        return self.kind if is_enum else None

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(m.value for m in self.enum_type) if self.enum_type else self.setting.choices

    def parse(self, text: str) -> Any:
        """The value of one flag's text (one item for a repeated flag); ValueError says why not."""
        text_kind = self.kind is tuple or self.enum_type is not None  # checked as text
        parse = self.setting.parse or (str if text_kind else self.kind)
        if parse is None or parse is bool:
            raise TypeError(f"setting {self.name} needs a parse function")
        try:
            return parse(text)
        except ValueError as e:
            why = {int: "expected an integer", float: "expected a number"}.get(parse, str(e))
            raise ValueError(why) from None

    def problem(self, value: Any) -> str | None:
        """Why `value` is not valid for this setting, or None."""
        if value is None:
            return None if self.optional else "must be set"
        if not _has_kind(value, self.kind):
            return "must be " + _KIND_NAMES[self.kind]
        if self.choices and value not in self.choices:
            return "must be one of " + ", ".join(map(str, self.choices))
        return next((c.why for c in self.setting.checks if not c.ok(value)), None)


_KIND_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    tuple: "a list of strings",
}


def _has_kind(value: Any, kind: type | None) -> bool:
    if kind not in _KIND_NAMES:
        return True  # several types: the checks decide; an enum: its choices do
    if kind is tuple:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


@functools.cache
def options(cls: type) -> tuple[Option, ...]:
    """The settings of a config dataclass, in declaration order (internal fields left out)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        meta = f.metadata.get(_KEY)
        if isinstance(meta, Setting):
            kind, optional = _resolve(hints[f.name])
            out.append(Option(f.name, meta, f.default, kind, optional))
    return tuple(out)


def undeclared(cls: type) -> list[str]:
    """Fields declared with neither `setting` nor `internal` (a test keeps this empty)."""
    return [f.name for f in fields(cls) if not isinstance(f.metadata.get(_KEY), Setting | Internal)]


def _resolve(hint: Any) -> tuple[type | None, bool]:
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    concrete = [a for a in args if a is not type(None)]
    optional = len(concrete) < len(args)
    if len(concrete) != 1:
        return None, optional
    kind = typing.get_origin(concrete[0]) or concrete[0]
    return kind, optional


def option(cls: type, name: str) -> Option:
    for opt in options(cls):
        if opt.name == name:
            return opt
    raise KeyError(f"{cls.__name__} has no setting {name!r}")


def pool_options(cls: type) -> tuple[Option, ...]:
    return tuple(o for o in options(cls) if o.setting.per_pool)


def require(ok: bool, name: str, value: object, why: str) -> None:
    """A rule across fields, which no single setting can state."""
    if not ok:
        raise ValueError(f"invalid {name}={value!r}: {why}")


def check_settings(obj: Any) -> None:
    """Validate every setting of a frozen config dataclass; enum fields given as text become
    enum members and lists become tuples. Raises ValueError naming the field and the value."""
    for opt in options(type(obj)):
        value = getattr(obj, opt.name)
        if opt.kind is tuple and isinstance(value, list):
            value = tuple(value)
            object.__setattr__(obj, opt.name, value)
        why = opt.problem(value)
        if why is not None:
            raise ValueError(f"invalid {opt.name}={value!r}: {why}")
        if value is not None and opt.enum_type is not None:
            object.__setattr__(obj, opt.name, opt.enum_type(value))


def check_overrides(cls: type, overrides: dict[str, Any], label: str) -> None:
    """Validate per-pool overrides of `cls`'s settings as the base settings are validated."""
    allowed = {o.name: o for o in pool_options(cls)}
    for name, value in overrides.items():
        if name not in allowed:
            known = ", ".join(allowed)
            raise ValueError(f"invalid {label} key {name!r}: not a per-pool setting ({known})")
        why = allowed[name].problem(value)
        if why is not None:
            raise ValueError(f"invalid {label}[{name!r}]={value!r}: {why}")


_SIZE_RE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: expected e.g. 512MiB, 2GiB, 1e9")
    num, unit = float(m.group(1)), (m.group(2) or "").lower()
    base = unit[:1]
    mult = 1024 ** "bkmgt".index(base) if "i" in unit and base != "b" else _UNITS[base]
    return int(num * mult)


def format_size(num_bytes: int) -> str:
    """16777216 -> '16MiB': the largest binary unit that divides the size."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes and num_bytes % (1 << shift) == 0:
            return f"{num_bytes >> shift}{unit}"
    return str(num_bytes)
