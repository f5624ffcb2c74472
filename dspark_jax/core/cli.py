"""What every command-line entry point shares: one-line errors and checked flags."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
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
