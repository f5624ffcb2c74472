"""What every command-line entry point shares: one-line errors and prompt-file reading."""

from __future__ import annotations

import functools
import json
import sys
from typing import Callable

from dspark_jax.errors import UserError


def run_cli(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Wrap an entry point: UserError -> `error: ...` on stderr and exit status 2, no traceback."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130

    return wrapped


def read_prompts_file(path: str) -> list[str]:
    """First user turn of every line of a `{"turns": [...]}` JSONL file."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise UserError(f"no such prompts file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompts file {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UserError(f"{path}:{number}: not valid JSON") from None
        turns = row.get("turns") if isinstance(row, dict) else None
        if not turns or not isinstance(turns, list) or not isinstance(turns[0], str):
            raise UserError(f'{path}:{number}: expected {{"turns": ["first user message", ...]}}')
        prompts.append(turns[0])
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts")
    return prompts
