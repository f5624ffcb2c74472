"""Reading the JSON / JSONL files users hand us, with one-line errors that name the file and line."""

from __future__ import annotations

import json
import re

from dspark_jax.core.errors import UserError

LOCAL_ONLY = ("URLs (gs://, s3://, ...) are not read or written directly yet: use a local or mounted folder "
              "(a bucket through gcsfuse, say)")


def is_url(path) -> bool:
    return bool(re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", str(path)))


def check_local(path, what: str) -> None:
    """A one-line UserError for a URL where a local path is needed (instead of a folder named "gs:")."""
    if is_url(path):
        raise UserError(f"{what} {path}: {LOCAL_ONLY}")


def read_json_object(path: str, what: str, missing: str = "", corrupt: str = "") -> dict:
    """A JSON file holding one object; a missing, unreadable or malformed file is a one-line
    UserError, ending with `missing` / `corrupt` (what to do about it) when given."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise UserError(f"no such {what} {path}{missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{what} {path} is unreadable or not JSON ({type(e).__name__}){corrupt}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{what} {path} is not a JSON object{corrupt}")
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
