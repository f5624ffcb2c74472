"""What every command-line entry point shares: one-line errors, checked flags, prompt-file reading."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
from typing import Any, Callable

from dspark_jax.core import config_checks
from dspark_jax.core.errors import UserError


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


def read_json_object(path: str, what: str) -> dict:
    """A JSON file holding one object; a missing, unreadable or malformed file is a one-line UserError."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise UserError(f"no such {what} {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is unreadable or not JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} is not a JSON object")
    return obj


def read_jsonl(path: str, what: str, allow_partial_last: bool = False) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line; one-line UserErrors naming `what`.

    allow_partial_last: a final line without a newline that does not parse is a record still being
    written by a live process (e.g. a training log) and is skipped rather than called corrupt.
    """
    try:
        # Bytes that are not UTF-8 are carried as surrogate escapes; text fields go through
        # tokenizer.clean_text (`read_prompts_file` does it), so they end as U+FFFD, not a crash.
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
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


def prompt_text(text: str) -> str:
    """A prompt from the outside world (argv, a file) as valid Unicode: bytes that are not UTF-8 and
    lone surrogates become U+FFFD, as in most tools (`tokenizer.clean_text`). Every command reads
    prompts through here, so the text echoed back is the text that was tokenised."""
    from dspark_jax.checkpoints.tokenizer import clean_text  # lazily: --help should not import tokenizers

    return clean_text(text)


def read_prompts_file(path: str) -> list[str]:
    """First user turn of every line of a `{"turns": [...]}` JSONL file (as `prompt_text`)."""
    prompts = []
    for number, row in read_jsonl(path, "prompts file"):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not turns or not isinstance(turns, list) or not isinstance(turns[0], str):
            raise UserError(f'{path}:{number}: expected {{"turns": ["first user message", ...]}}')
        prompts.append(prompt_text(turns[0]))
    if not prompts:
        raise UserError(f"prompts file {path} holds no prompts")
    return prompts


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt for `decode`: `text` (a single user turn) or `messages` (a whole conversation,
    rendered with the chat template), with `source` ("FILE:LINE" or "--prompt N") for messages."""

    source: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None  # ({"role": str, "content": str}, ...), text cleaned


PROMPT_FORMATS = ('{"prompt": "..."}, {"messages": [{"role": "user", "content": "..."}, ...]} or '
                  '{"turns": ["first user message", ...]}')


def _message_content(content) -> str | None:
    """An OpenAI-style message content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        return "".join(part["text"] for part in content)
    return None


def prompt_record(row, source: str) -> PromptRecord:
    """A parsed prompts-file line as a PromptRecord (every text as `prompt_text`); a UserError
    naming `source` when it is not one of PROMPT_FORMATS."""
    keys = [k for k in ("prompt", "messages", "turns") if isinstance(row, dict) and k in row]
    if len(keys) != 1:
        what = "more than one of prompt / messages / turns" if len(keys) > 1 else "no prompt"
        raise UserError(f"{source}: {what}; expected one of {PROMPT_FORMATS}")
    key, value = keys[0], row[keys[0]]
    if key == "prompt":
        if not isinstance(value, str):
            raise UserError(f'{source}: "prompt" must be a string')
        return PromptRecord(source, text=prompt_text(value))
    if key == "turns":
        if not value or not isinstance(value, list) or not isinstance(value[0], str):
            raise UserError(f'{source}: expected {{"turns": ["first user message", ...]}}')
        return PromptRecord(source, text=prompt_text(value[0]))
    if not value or not isinstance(value, list):
        raise UserError(f'{source}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}')
    messages = []
    for number, m in enumerate(value, 1):
        role = m.get("role") if isinstance(m, dict) else None
        content = _message_content(m.get("content")) if isinstance(m, dict) else None
        if not isinstance(role, str) or not role or content is None:
            raise UserError(f'{source}: message {number} must be {{"role": "...", "content": "..."}} '
                            "(content a string or a list of text parts)")
        messages.append({"role": prompt_text(role), "content": prompt_text(content)})
    return PromptRecord(source, messages=tuple(messages))


def read_prompt_records(path: str) -> list[PromptRecord]:
    """Every line of a decode prompts file, in file order: {"prompt": ...}, OpenAI-style
    {"messages": [...]} or {"turns": [...]} (its first turn, as `read_prompts_file`). Blank lines
    are skipped; a line in none of these forms is a one-line UserError with its line number."""
    records = [prompt_record(row, f"{path}:{number}") for number, row in read_jsonl(path, "prompts file")]
    if not records:
        raise UserError(f"prompts file {path} holds no prompts")
    return records
