"""What every command-line entry point shares: one-line errors, checked flags, flags made from the
fields of a settings dataclass (and the settings built back from them), the multi-process flags.

A command's settings are a frozen dataclass whose fields carry their type, range, default and help
(`config_checks.setting`); the entry point adds one flag per field (`add_setting`), parses, and
builds the value (`settings_from`) that the library below takes: no function below the entry
points reads an argparse namespace."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import typing
from typing import Any, Callable

from dspark_jax.core import config_checks, host_memory
from dspark_jax.core.errors import UserError


def run_cli(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap an entry point: UserError -> `error: ...` on stderr and exit status 2, no traceback; malloc
    set to keep freed memory before the backend starts (`host_memory`)."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        host_memory.keep_freed_memory()
        try:
            return main(argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapped


_FLAG = "\0flag"  # the flag's name in a type error; argparse knows it, a `type=` does not


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (a bad or missing flag) are UserErrors: one `error: ...` line, exit 2."""

    def error(self, message: str):
        m = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
        if m and _FLAG in m[2]:  # "argument -g/--gamma: \0flag must be ..." -> "--gamma must be ..."
            message = m[2].replace(_FLAG, max(m[1].split("/"), key=len))
        raise UserError(message)


def flag(hint: type, **rule) -> Callable[[str], Any]:
    """An argparse `type=` with the config checks: `flag(int, ge=1)`, `flag(float, ge=0, le=1)`."""
    return _flag(hint, config_checks.Rule(**rule))


def setting_flag(cls, name: str) -> Callable[[str], Any]:
    """The `type=` of a flag that sets field `name` of config dataclass `cls`: its declared type and range."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _flag(config_checks.hints(cls)[name], field.metadata.get("rule", config_checks.NO_RULE))


def add_setting(parser, cls, name: str, *flags: str, **overrides) -> argparse.Action:
    """The flag that sets field `name` of settings dataclass `cls` (`--name-with-dashes`, or the
    field's own `flag`): its type, range or choices, default, help and metavar come from the field
    (`config_checks.setting`; `overrides` may replace any). A field without a default is a required
    flag, a bool field a switch (`--x`; `--no-x` where its flag says so, or `--x/--no-x` where it
    defaults to true or to None: undecided), a tuple field a repeatable flag."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    hint = config_checks.hints(cls)[name]
    rule = field.metadata.get("rule", config_checks.NO_RULE)
    base = config_checks.unwrap_optional(hint) or hint
    flags = flags or (field.metadata.get("flag") or "--" + name.replace("_", "-"),)
    kw: dict[str, Any] = dict(dest=name, default=field.default, help=field.metadata.get("doc"))
    if field.default is dataclasses.MISSING:
        kw.update(required=True, default=None)
    if field.metadata.get("metavar"):
        kw["metavar"] = field.metadata["metavar"]
    if base is bool:
        kw["action"] = ("store_true" if field.default is False else "store_false" if flags[0].startswith("--no-")
                        else argparse.BooleanOptionalAction)
    elif typing.get_origin(base) is tuple:
        kw.update(action="append", default=list(field.default), type=_flag(typing.get_args(base)[0], rule))
    elif rule.choices is not None:
        kw["choices"] = rule.choices
    else:
        kw["type"] = _flag(base, rule)
    kw.update(overrides)
    return parser.add_argument(*flags, **kw)


def add_settings(parser, cls, **overrides: dict) -> None:
    """A flag per field of settings dataclass `cls` (`add_setting`; `overrides[field]`: that flag's
    replaced arguments), in the argument group `cls.FLAG_GROUP` if it names one. A field that holds
    settings of its own has no flag: its fields have theirs (`add_settings` of its class)."""
    group = parser.add_argument_group(cls.FLAG_GROUP) if getattr(cls, "FLAG_GROUP", None) else parser
    for field in dataclasses.fields(cls):
        if not dataclasses.is_dataclass(config_checks.hints(cls)[field.name]):
            add_setting(group, cls, field.name, **overrides.get(field.name, {}))


def settings_from(cls, args: argparse.Namespace, **values):
    """Settings dataclass `cls` from the parsed flags of the same names (and `values`, which win)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names} | values)


def _flag(hint, rule) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = hint(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_FLAG} must be {config_checks.kind(hint, rule)}, got {text}") from None
        try:
            return config_checks.convert(_FLAG, value, hint, rule)
        except config_checks.ConfigError as e:  # shown as typed: --top-p 0, not 0.0
            raise argparse.ArgumentTypeError(e.message.rpartition(", got ")[0] + f", got {text}") from None

    parse.__name__ = getattr(hint, "__name__", "value")
    return parse


POSITIVE_INT = flag(int, ge=1)
NON_NEGATIVE_INT = flag(int, ge=0)
NON_NEGATIVE_FLOAT = flag(float, ge=0)
UNIT_INTERVAL = flag(float, ge=0, le=1)  # a probability threshold: [0, 1]
