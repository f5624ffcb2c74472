"""The fixed train / eval split of the benchmark prompt sets in `dspark_jax/prompts/*.jsonl`.

Rule (never change it silently: reported acceptance lengths rely on it):

* A prompt is identified by its text (the first user turn). Its bucket is
  u = int(sha256(utf-8 text)[:8 bytes], big-endian) / 2**64, a number in [0, 1).
* It belongs to the EVAL split of set `s` if u < EVAL_FRACTION[s] (default 0.10), else to TRAIN.
  The decision depends on the prompt's own text only, so adding prompts to a file never moves an
  existing prompt from one side to the other, and identical prompts always land on the same side.
* Fractions are raised above 10% for small sets so that each has at least 20 eval prompts
  (humaneval 164 -> 29, lbpp 162 -> 25); aime24 (30 prompts) is evaluation-only.
* Safety net: a prompt that is eval in ANY set is never returned as training data by any set.
  Within a set, duplicate texts are kept once (first occurrence).

Resulting sizes (train / eval): gsm8k 1186/133, math500 439/61, aime24 0/30, humaneval 135/29,
mbpp 230/26, livecodebench 954/101, lbpp 137/25, swe-bench 276/24, arena-hard-v2 667/83.
Both lists keep the file order.
"""

from __future__ import annotations

import functools
import hashlib
import os

from dspark_jax.data.prompt_files import read_prompts_file
from dspark_jax.core.errors import UserError

PROMPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prompts")

DOMAINS: dict[str, tuple[str, ...]] = {
    "math": ("gsm8k", "math500", "aime24"),
    "code": ("humaneval", "mbpp", "livecodebench", "lbpp", "swe-bench"),
    "chat": ("arena-hard-v2",),
}
DEFAULT_EVAL_FRACTION = 0.10
EVAL_FRACTION: dict[str, float] = {"humaneval": 0.15, "lbpp": 0.15, "aime24": 1.0}
SPLITS = ("train", "eval")


def list_domains() -> dict[str, tuple[str, ...]]:
    """{domain: (set names...)} for math, code and chat."""
    return dict(DOMAINS)


def list_sets() -> tuple[str, ...]:
    """Every prompt set name, domain by domain."""
    return tuple(s for sets in DOMAINS.values() for s in sets)


def domain_of(name: str) -> str:
    for domain, sets in DOMAINS.items():
        if name in sets:
            return domain
    raise UserError(f"unknown prompt set {name!r} (known: {', '.join(list_sets())})")


def prompt_hash(text: str) -> str:
    """Hex sha256 of the prompt text (the prompt's identity everywhere in the data pipeline)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def prompt_bucket(text: str) -> float:
    """The prompt's position in [0, 1) that decides its split."""
    return int(prompt_hash(text)[:16], 16) / 2.0**64


def eval_fraction(name: str) -> float:
    return EVAL_FRACTION.get(name, DEFAULT_EVAL_FRACTION)


@functools.lru_cache(maxsize=None)
def load_set(name: str) -> tuple[str, ...]:
    """All prompts of one set (first user turns, file order, duplicates dropped)."""
    domain_of(name)  # validates the name
    prompts = read_prompts_file(os.path.join(PROMPTS_DIR, f"{name}.jsonl"))
    return tuple(dict.fromkeys(prompts))


@functools.lru_cache(maxsize=None)
def _eval_everywhere() -> frozenset[str]:
    return frozenset(p for s in list_sets() for p in load_set(s) if prompt_bucket(p) < eval_fraction(s))


def split_prompts(name: str) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts) of one set, each in file order; disjoint, deterministic."""
    prompts = load_set(name)
    fraction = eval_fraction(name)
    held_out = _eval_everywhere()
    train = [p for p in prompts if prompt_bucket(p) >= fraction and p not in held_out]
    evals = [p for p in prompts if prompt_bucket(p) < fraction]
    return train, evals


def get_split(name: str, split: str) -> list[str]:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r} (use one of: {', '.join(SPLITS)})")
    train, evals = split_prompts(name)
    return train if split == "train" else evals


def parse_sets(spec: str) -> list[str]:
    """'gsm8k,humaneval' (or a domain name such as 'math', or 'all') -> validated set names."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part == "all":
            names += list_sets()
        elif part in DOMAINS:
            names += DOMAINS[part]
        else:
            domain_of(part)
            names.append(part)
    if not names:
        raise UserError("no prompt sets given (e.g. --sets gsm8k,humaneval)")
    return list(dict.fromkeys(names))


# The domains the speed and serving benchmarks (and the serving simulator's recordings) measure:
# a mix of each domain's main sets, eval split only.
BENCHMARK_DOMAINS: dict[str, tuple[str, ...]] = {"math": ("gsm8k", "math500"), "code": ("humaneval", "mbpp"),
                                                 "chat": ("arena-hard-v2",)}


def eval_prompts(tokenizer, sets, limit: int, max_prompt_tokens: int) -> list[list[int]]:
    """Chat-templated token ids of up to `limit` prompts from the EVAL split of `sets` (never trained
    on), taken round robin over the sets in file order, skipping prompts longer than
    `max_prompt_tokens`."""
    pools = [iter(get_split(s, "eval")) for s in parse_sets(",".join(sets))]
    out: list[list[int]] = []
    while pools and len(out) < limit:
        for pool in list(pools):
            text = next(pool, None)
            if text is None:
                pools.remove(pool)
                continue
            ids = tokenizer.chat_prompt_ids(text)
            if len(ids) <= max_prompt_tokens and len(out) < limit:
                out.append(ids)
    return out


def mixed_eval_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """`count` eval prompts of the benchmark domains, math / code / chat in turn (what
    benchmarks/bench_serving.py serves and the simulator records)."""
    import itertools

    per_domain = [eval_prompts(tokenizer, sets, count, max_prompt_tokens) for sets in BENCHMARK_DOMAINS.values()]
    mixed = [p for group in itertools.zip_longest(*per_domain) for p in group if p is not None]
    if len(mixed) < count:
        raise UserError(f"only {len(mixed)} eval prompts of at most {max_prompt_tokens} tokens in the math / code / "
                        "chat mix: ask for fewer or raise the prompt-length limit")
    return mixed[:count]
