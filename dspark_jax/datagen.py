"""`python -m dspark_jax.datagen`: regenerate training responses with the target.

    python -m dspark_jax.datagen --target smollm2-135m --sets gsm8k,humaneval,arena-hard-v2 \
        --split train --out data/smollm2-train [--limit N] [--max-new-tokens 512]

The plan, the resumability and the output format are described in `dspark_jax.training.datagen`.
With the multi-process flags (`dspark_jax.distributed.runtime`) several processes share the
shards, each generating every N-th one; process 0 writes the manifest.
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, add_settings, flag, run_cli, setting_flag, settings_from
from dspark_jax.core.errors import UserError
from dspark_jax.core import files
from dspark_jax.distributed import gather, runtime


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET
    from dspark_jax.models.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.datagen",
                       description="Regenerate training responses with the target model.")
    p.add_argument("--target", default=DEFAULT_TARGET, help="known name, Hugging Face folder or .gguf file")
    p.add_argument("--sets", required=True,
                   help="comma-separated prompt sets (or domains math/code/chat, or all)")
    p.add_argument("--split", default="train", help="train or eval (see dspark_jax/data/splits.py)")
    p.add_argument("--out", required=True, help="output folder or gs:// URL (resumed if it holds the same run)")
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="at most N prompts per set (first N in file order)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=512)
    p.add_argument("--max-prompt-tokens", type=POSITIVE_INT, default=1024,
                   help="a longer prompt keeps the start and the end of its text")
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=0.7)
    p.add_argument("--top-p", type=setting_flag(SamplingConfig, "top_p"), default=0.8)
    p.add_argument("--top-k", type=setting_flag(SamplingConfig, "top_k"), default=20)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=32,
                   help="rows decoding together (continuous batching; the responses do not depend on it)")
    p.add_argument("--shard-size", type=POSITIVE_INT, default=64, help="examples per shard file")
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights' dtype; bfloat16 keeps fp32 activations on a CPU and is much faster "
                        "for verify passes and batches on CPUs with AMX or AVX512-BF16 (docs/results.md section 9)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_settings(p, runtime.ProcessSettings)
    return p.parse_args(argv)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.initialize(settings_from(runtime.ProcessSettings, args))  # before anything touches devices
    from dspark_jax.data.shards import read_manifest
    from dspark_jax.training import datagen
    from dspark_jax.data.splits import SPLITS, parse_sets

    files.path(args.out)  # an unusable URL (scheme, no gcsfs) fails here, before the target loads
    if args.split not in SPLITS:
        raise UserError(f"unknown split {args.split!r} (use one of: {', '.join(SPLITS)})")
    sets = parse_sets(args.sets)
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    from dspark_jax.data.splits import get_split

    named = {part.strip() for part in args.sets.split(",")}
    for name in list(sets):  # before the (slow) target load
        if not get_split(name, args.split):
            if name in named:
                raise UserError(f"prompt set {name!r} has no {args.split} prompts")
            sets.remove(name)  # part of "all" or a domain (aime24 is eval-only)

    from dspark_jax.checkpoints.registry import load_target

    target = load_target(args.target, dtype=args.dtype)
    try:
        before = read_manifest(args.out)["response_tokens"] if gather.is_primary() else 0
    except UserError:  # a new folder (a foreign one is refused below)
        before = 0
    t0 = time.perf_counter()
    m = datagen.generate_dataset(target, sets, args.split, args.out, limit=args.limit, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         batch_size=args.batch_size, shard_size=args.shard_size, seed=args.seed,
                         max_prompt_tokens=args.max_prompt_tokens, progress=not args.quiet)
    if not gather.is_primary():
        return 0
    state = "complete" if m["complete"] else "incomplete"
    processes = f", {gather.process_count()} processes" if gather.process_count() > 1 else ""
    seconds = time.perf_counter() - t0
    new = m["response_tokens"] - before
    print(f"{args.out}: {m['num_examples']}/{m['num_planned']} examples, {m['response_tokens']} response tokens, "
          f"{len(m['shards'])}/{m['num_shards_planned']} shards ({state}{processes}); this run: {new} response "
          f"tokens in {seconds:.0f}s, {new / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
