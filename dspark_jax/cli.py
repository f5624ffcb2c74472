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


def read_jsonl(path: str, what: str, allow_partial_last: bool = False) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line; one-line UserErrors naming `what`.

    allow_partial_last: a final line without a newline that does not parse is a record still being
    written by a live process (e.g. a training log) and is skipped rather than called corrupt.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"no such {what}: {path}") from None
    except IsADirectoryError:
        raise UserError(f"{what} {path} is a directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError:
            if allow_partial_last and number == len(lines) and not text.endswith("\n"):
                break
            raise UserError(f"{path}:{number}: not valid JSON (corrupt {what})") from None
    return rows


def read_prompts_file(path: str) -> list[str]:
    """First user turn of every line of a `{"turns": [...]}` JSONL file."""
    prompts = []
    for number, row in read_jsonl(path, "prompts file"):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not turns or not isinstance(turns, list) or not isinstance(turns[0], str):
            raise UserError(f'{path}:{number}: expected {{"turns": ["first user message", ...]}}')
        prompts.append(turns[0])
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts")
    return prompts
