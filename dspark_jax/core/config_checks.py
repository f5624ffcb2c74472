"""Typed, ranged settings for the frozen config dataclasses, checked when a config is built.

A field declares its range next to its default, and the dataclass checks itself on construction:

    @dataclasses.dataclass(frozen=True)
    class OptimConfig:
        lr: float = setting(6e-4, gt=0)
        steps: int = setting(1000, ge=1)
        def __post_init__(self):
            validate(self)

The type comes from the annotation: an int is an int (not a bool, not 1.5, not "3"); a float field
takes any finite number (ints become floats); a bool is true or false; a tuple field takes a list or
a tuple and checks each element (the range applies to each element); `X | None` also takes null
(and an optional string also takes false or "none": a switched-off path); a dataclass-typed field
takes an instance or a mapping of its fields. Relations between fields (`relation(...)` in the
class's `__relations__`) are checked after every field. Every failure is a `ConfigError` (a
UserError) naming the field; `check` also validates a partial mapping before the full config can be
built (e.g. the drafter section of a training config, before the target supplies its dimensions).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
import types
import typing
from typing import Any, Callable, Mapping

from dspark_jax.core.errors import UserError


class ConfigError(UserError):
    """A bad setting; `key` is the field's name (callers prefix a section and a source)."""

    def __init__(self, key: str, message: str, related: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.message, self.related = key, message, related  # related: other fields of a relation

    def within(self, prefix: str = "", source: str = "") -> "ConfigError":
        """The same error with the keys under `prefix` ("drafter.") and the source in front."""
        message = self.message
        if prefix:  # the first mention of the key, as a whole word
            message = re.sub(rf"(?<![\w.]){re.escape(self.key)}(?![\w.])", lambda _: prefix + self.key, message, 1)
        return ConfigError(prefix + self.key, f"{source}: {message}" if source else message,
                           tuple(prefix + k for k in self.related))


@dataclasses.dataclass(frozen=True)
class Rule:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None

    def holds(self, v) -> bool:  # written so that NaN fails every bound
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt)
                and (self.choices is None or v in self.choices))

    def require(self, subject: str) -> str:
        """The rule as a demand on `subject`: "steps must be at least 1", "need 0 < top_p <= 1"."""
        if self.choices is not None:
            return f"{subject} must be one of {', '.join(map(str, self.choices))}"
        lo = ("<=", self.ge) if self.ge is not None else ("<", self.gt) if self.gt is not None else None
        hi = ("<=", self.le) if self.le is not None else ("<", self.lt) if self.lt is not None else None
        if lo and hi:
            return f"need {lo[1]} {lo[0]} {subject} {hi[0]} {hi[1]}"
        if lo:
            return f"{subject} must be {'at least' if lo[0] == '<=' else 'greater than'} {lo[1]}"
        if hi:
            return f"{subject} must be {'at most' if hi[0] == '<=' else 'less than'} {hi[1]}"
        return ""


NO_RULE = Rule()


def setting(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None, choices=None,
            doc: str | None = None, flag: str | None = None, metavar: str | None = None):
    """A dataclass field with a range (`ge`/`gt`/`le`/`lt`) or a set of `choices`, and what it means
    (`doc`: the help of the command-line flag that sets it, `core.cli.add_setting`; `flag` where that
    is not --the-field-name, e.g. --no-progress for `progress`; `metavar` for its help)."""
    rule = Rule(ge, gt, le, lt, None if choices is None else tuple(choices))
    return dataclasses.field(default=default, metadata={"rule": rule, "doc": doc, "flag": flag, "metavar": metavar})


@dataclasses.dataclass(frozen=True)
class Relation:
    keys: tuple[str, ...]  # the first is the one the error names
    holds: Callable[..., bool]  # called with the keys' values as keyword arguments
    message: str  # formatted with the same values: "{key} must ..."


def relation(keys: str, holds: Callable[..., bool], message: str) -> Relation:
    """A rule over several fields, e.g. relation("markov_rank head", lambda markov_rank, head: ...)."""
    return Relation(tuple(keys.split()), holds, message)


def show(v) -> str:
    """A value as the user wrote it in YAML (true, null) or Python (strings quoted)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else repr(v)


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
_PLURALS = {int: "integers", float: "numbers", str: "strings"}


def unwrap_optional(hint) -> Any:
    """X for `X | None`, else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return None


def kind(hint, rule: Rule = NO_RULE) -> str:
    """What type of value a field takes, in words: "an integer", "a list of 3 integers", "one of a, b"."""
    if unwrap_optional(hint) is not None:
        return kind(unwrap_optional(hint), rule) + " or null"
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        n = "" if args[-1] is Ellipsis else f"{len(args)} "
        return f"a list of {n}{_PLURALS.get(args[0], args[0])}"
    if rule.choices is not None:
        return "one of " + ", ".join(map(str, rule.choices))
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _wrong_type(key, hint, rule, v, note=""):
    raise ConfigError(key, f"{key} must be {kind(hint, rule)}, got {show(v)}{note}")


def convert(key: str, value, hint, rule: Rule = NO_RULE):
    """The value of field `key` (type `hint`, range `rule`) as stored, or a ConfigError."""
    v = value
    inner = unwrap_optional(hint)
    if inner is not None:
        if inner is str and (v is False or (isinstance(v, str) and v.strip().lower() == "none")):
            return None  # an optional path switched off (YAML: false, no, off, null, ~, none)
        if v is None:
            return None
        try:
            return convert(key, v, inner, rule)
        except ConfigError as e:
            if e.key != key or not e.message.startswith(f"{key} must be {kind(inner, rule)},"):
                raise  # a field of a nested config, or a value out of range
            _wrong_type(key, inner if inner is str else hint, rule, v,
                        " (false, null or none switch it off)" if inner is str else "")
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(v, (list, tuple)) or (args[-1] is not Ellipsis and len(v) != len(args)):
            _wrong_type(key, hint, rule, v)
        out = []
        for i, x in enumerate(v):
            elem = args[0] if args[-1] is Ellipsis else args[i]
            try:
                out.append(convert(key, x, elem))
            except ConfigError:
                _wrong_type(key, hint, rule, v)
            if not rule.holds(out[-1]):
                raise ConfigError(key, f"{rule.require(f'every element of {key}')}, got {show(value)}")
        return tuple(out)
    if dataclasses.is_dataclass(hint):
        if isinstance(v, hint):
            return v
        if not isinstance(v, Mapping):
            _wrong_type(key, hint, rule, v)
        try:
            return hint(**check(hint, v, section=key))
        except ConfigError as e:
            raise e.within(key + ".") from None
    if hint is int:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            _wrong_type(key, hint, rule, v)
        v = int(v)
    elif hint is float:  # ints are numbers too; NaN and infinities are no setting's value
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            _wrong_type(key, hint, rule, v)
        v = float(v)
    elif hint in (bool, str, dict):
        if not isinstance(v, Mapping if hint is dict else hint):
            _wrong_type(key, hint, rule, v)
    elif hint is not Any:
        raise TypeError(f"config_checks cannot check {key}: {hint}")  # a programming error, not a user's
    if not rule.holds(v):
        if rule.choices is not None:
            _wrong_type(key, hint, rule, value)
        raise ConfigError(key, f"{rule.require(key)}, got {show(value)}")
    return v


@functools.cache
def hints(cls) -> dict:
    """The resolved annotations of dataclass `cls`, by field name."""
    return typing.get_type_hints(cls)


def check(cls, values: Mapping, *, partial: bool = False, section: str = "") -> dict:
    """Check `values` against the fields of dataclass `cls`; the converted values.

    partial: `values` may lack fields without a default; relations between fields that are
    neither given nor defaulted are left for when the whole config is built.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in values:
        if k not in fields:
            raise ConfigError(str(k), f"unknown {section or cls.__name__} setting {k!r} "
                                      f"(known: {', '.join(fields)})")
    types_ = hints(cls)
    out = {k: convert(k, v, types_[k], fields[k].metadata.get("rule", NO_RULE)) for k, v in values.items()}
    if not partial:
        missing = [k for k, f in fields.items() if k not in out and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(missing[0], f"{missing[0]} is required")
    known = {k: f.default for k, f in fields.items() if f.default is not dataclasses.MISSING} | out
    for r in getattr(cls, "__relations__", ()):
        if all(k in known for k in r.keys):
            vals = {k: known[k] for k in r.keys}
            if not r.holds(**vals):
                raise ConfigError(r.keys[0], r.message.format(**vals), r.keys[1:])
    return out


def validate(obj) -> None:
    """`__post_init__` of a config dataclass: check every field, store the converted values."""
    values = check(type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    for k, v in values.items():
        if v is not getattr(obj, k):
            object.__setattr__(obj, k, v)
