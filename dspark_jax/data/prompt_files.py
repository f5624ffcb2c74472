"""Prompts from the outside world: argv text and prompts files (`{"prompt"}`, `{"messages"}`, `{"turns"}` lines)."""

from __future__ import annotations

import dataclasses

from dspark_jax.core.errors import UserError
from dspark_jax.core.files import read_jsonl


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
