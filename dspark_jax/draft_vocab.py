"""Give a trained DSpark drafter a draft vocabulary: the N most frequent response tokens of its data.

    python -m dspark_jax.draft_vocab --drafter DIR --data TRAIN_DIR --held-out EVAL_DIR --sizes 8192,16384,32768
    python -m dspark_jax.draft_vocab --drafter DIR --data TRAIN_DIR --held-out EVAL_DIR --size 16384 [--save-to OUT]

The first form prints what each N covers of the training and held-out responses' tokens and writes
nothing; the second writes the drafter with the N-token vocabulary (in place, or to --save-to),
weights and calibrations unchanged (`--size 0`: the whole vocabulary again). Decoding then drafts
over the N tokens only (a cheaper drafter pass) and stays lossless (training/draft_vocab.py).
"""

from __future__ import annotations

import json
import sys

from dspark_jax.core.cli import ArgumentParser, flag, run_cli
from dspark_jax.core.errors import UserError


@run_cli
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dspark_jax.draft_vocab", description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="DSpark / DFlash drafter folder")
    p.add_argument("--data", required=True, help="its training data: a datagen folder, or a folder of them")
    p.add_argument("--held-out", default=None, help="held-out datagen folder(s) to measure coverage on")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--size", type=flag(int, ge=0), help="N tokens (0: the whole vocabulary); writes the drafter")
    what.add_argument("--sizes", help="comma-separated N to print the coverage of; writes nothing")
    p.add_argument("--save-to", default=None, help="write the drafter here instead of updating --drafter in place")
    args = p.parse_args(argv)

    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.training import draft_vocab

    drafter = load_drafter(args.drafter)
    if args.sizes is not None:
        try:
            sizes = [int(n) for n in args.sizes.split(",")]
        except ValueError:
            raise UserError(f"--sizes: expected comma-separated integers, got {args.sizes!r}") from None
        for row in draft_vocab.coverage_table(args.data, args.held_out, sizes, drafter.config.vocab_size):
            print(json.dumps(row.__dict__))
        return 0
    restricted = draft_vocab.with_draft_vocabulary(drafter, args.data, args.size)
    coverage = None
    if args.size:
        coverage = draft_vocab.coverage_table(args.data, args.held_out, [args.size], drafter.config.vocab_size)[0]
    note = {"draft_vocab": None if coverage is None else {"data": args.data, "held_out": args.held_out,
                                                           **coverage.__dict__}}
    out = args.save_to or args.drafter
    draft_vocab.save_loaded(restricted, out, note)
    print(json.dumps({"drafter": out, **note}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
