"""A draft vocabulary for an already trained DSpark drafter (DESIGN.md 2.7).

The drafter then scores only the N most frequent response tokens of its training data: its LM head
is those N rows of the target's, its Markov bias those N rows of its table, and every other token
has draft probability exactly zero. Its distribution over the N tokens is the trained one
renormalised (a softmax over a subset of the same logits), so nothing is retrained, and speculative
decoding stays lossless (a token the drafter cannot propose comes from the target's residual).
What it costs is coverage: a target token outside the N is never drafted, which caps every draft
position's acceptance; what it buys is a cheaper drafter pass. Both are measured on held-out
responses before anything is written.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.core.errors import UserError
from dspark_jax.data.pipeline import draft_vocabulary, vocabulary_coverage
from dspark_jax.drafters.checkpoint import LoadedDrafter, save_drafter
from dspark_jax.training.trainer import load_data


@dataclasses.dataclass(frozen=True)
class Coverage:
    size: int  # N (0: the whole vocabulary)
    train: float  # share of the training responses' tokens among the N
    held_out: float | None  # the same on held-out responses


def coverage_table(train_dir: str, held_out_dir: str | None, sizes, vocab_size: int) -> list[Coverage]:
    """Coverage of the N most frequent training response tokens, for each N in `sizes`."""
    train = load_data(train_dir)
    held_out = load_data(held_out_dir) if held_out_dir else None
    rows = []
    for n in sizes:
        if n >= vocab_size:
            raise UserError(f"a draft vocabulary of {n} tokens is not below the target's {vocab_size}")
        ids, share = draft_vocabulary(train, n, vocab_size)
        rows.append(Coverage(n, share, None if held_out is None else vocabulary_coverage(held_out, ids, vocab_size)))
    return rows


def with_draft_vocabulary(drafter: LoadedDrafter, train_dir: str, size: int) -> LoadedDrafter:
    """`drafter` drafting over the `size` most frequent response tokens of train_dir (size 0: the
    whole vocabulary again). The weights are untouched: the vocabulary is a choice of rows."""
    dcfg = drafter.config
    if dcfg.kind != "dspark":
        raise UserError(f"a draft vocabulary is for DSpark / DFlash drafters (this one is {dcfg.kind})")
    if size >= dcfg.vocab_size:
        raise UserError(f"a draft vocabulary of {size} tokens is not below the target's {dcfg.vocab_size}")
    ids = draft_vocabulary(load_data(train_dir), size, dcfg.vocab_size)[0] if size else ()
    return dataclasses.replace(drafter, config=dcfg.replace(draft_vocab_size=size, draft_vocab=ids))


def save_loaded(drafter: LoadedDrafter, path: str, metadata: dict) -> None:
    """Write `drafter` (its weights, calibrations and storage dtype as loaded) with `metadata` added."""
    save_drafter(path, drafter.config, drafter.params, sts_temperatures=drafter.sts_temperatures,
                 sts_by_temperature=drafter.sts_by_temperature, metadata={**drafter.metadata, **metadata},
                 dtype=drafter.storage_dtype)
