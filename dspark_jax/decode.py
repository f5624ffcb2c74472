"""Offline generation: `python -m dspark_jax.decode --prompt "..."`.

Prompts are rendered with the target's own chat template (one user turn) unless --raw is given,
run in batches of --batch-size, and printed readably or, with --json, as one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.cli import read_prompts_file, run_cli
from dspark_jax.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET, KNOWN_TARGETS

    p = argparse.ArgumentParser(prog="python -m dspark_jax.decode", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"known name ({', '.join(KNOWN_TARGETS)}), Hugging Face folder or .gguf file")
    p.add_argument("--drafter", default="none", help="drafter checkpoint, or 'none' for plain target decoding")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help='JSONL of {"turns": [...]} (the first turn is used)')
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, no progress bar")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UserError("need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    return args


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise UserError("give at least one --prompt or a --prompts-file")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise UserError(f"prompt {i + 1} is empty")
    if args.drafter != "none":
        raise UserError("speculative decoding with a drafter is not available yet: use --drafter none")

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.generate import generate
    from dspark_jax.sampling import SamplingConfig

    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    encoded = [tok.encode(t) if args.raw else tok.chat_prompt_ids(t) for t in prompts]
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    for start in range(0, len(prompts), args.batch_size):
        batch = encoded[start: start + args.batch_size]
        result = generate(target.params, target.config, batch, max_new_tokens=args.max_new_tokens,
                          sampling=sampling, stop_ids=tok.eos_token_ids, seed=args.seed + start,
                          progress=not args.json)
        for i, ids in enumerate(result.token_ids):
            record = {
                "prompt": prompts[start + i],
                "text": tok.decode(ids),
                "token_ids": ids,
                "prompt_token_ids": list(batch[i]),
                "num_tokens": len(ids),
                "finish_reason": "stop" if ids and ids[-1] in tok.eos_token_ids else "length",
                "wall_s": round(result.wall_s, 4),
                "tokens_per_s": round(len(ids) / result.wall_s, 2),
                "batch_size": len(batch),
                "target": target.name,
            }
            if args.json:
                print(json.dumps(record, ensure_ascii=False), flush=True)
            else:
                print(f"### {record['prompt']}\n{record['text']}\n"
                      f"[{record['num_tokens']} tokens, {record['wall_s']:.2f} s, "
                      f"{record['tokens_per_s']:.1f} tokens/s]\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
