"""Offline generation: `python -m dspark_jax.decode --prompt "..."`.

Prompts are rendered with the target's own chat template (one user turn) unless --raw is given,
run in batches of --batch-size, and printed readably or, with --json, as one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.cli import POSITIVE_INT, ArgumentParser, flag, prompt_text, read_prompts_file, run_cli, setting_flag
from dspark_jax.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET, KNOWN_TARGETS
    from dspark_jax.engine.speculative import SpecConfig
    from dspark_jax.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.decode", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"known name ({', '.join(KNOWN_TARGETS)}), Hugging Face folder or .gguf file")
    p.add_argument("--drafter", default="default",
                   help="drafter checkpoint folder; 'default' = the drafter shipped for the target (plain decoding "
                        "if there is none); 'none' = plain target decoding")
    p.add_argument("--scheduler", default="auto",
                   choices=["auto", "fixed", "mtp1", "threshold", "dspark", "dspark-async"],
                   help="draft tokens verified per request and round (docs/decoding.md); "
                        "auto = dspark with a confidence head, else fixed")
    p.add_argument("--sps-table", default=None,
                   help="SPS table JSON for the dspark schedulers (default: .dspark_cache/, profiled when missing)")
    p.add_argument("--profile-sps", action="store_true", help="re-profile the SPS table even if one exists")
    p.add_argument("--gamma", type=setting_flag(SpecConfig, "gamma"), default=None,
                   help="draft tokens per round, 1 to the drafter's block size (default: the block size)")
    p.add_argument("--threshold", type=setting_flag(SpecConfig, "threshold"), default=0.5,
                   help="prefix-survival threshold in [0, 1] for --scheduler threshold")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run plain target decoding and report the speedup "
                        "(default: on for readable output with a drafter, off with --json)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help='JSONL of {"turns": [...]} (the first turn is used)')
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=setting_flag(SamplingConfig, "top_k"), default=0, help="0 = off")
    p.add_argument("--top-p", type=setting_flag(SamplingConfig, "top_p"), default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8, help="prompts decoded together")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, no progress bar")
    return p.parse_args(argv)


def drafter_settings(args, dcfg) -> tuple[str, int]:
    """(scheduler, gamma) for this drafter: `--scheduler auto` resolved, --gamma and the scheduler
    checked against what the drafter has (its block size, a confidence head)."""
    scheduler = auto_scheduler(dcfg, args.batch_size) if args.scheduler == "auto" else args.scheduler
    gamma = args.gamma or dcfg.block_size
    if gamma < 1 or (dcfg.kind == "dspark" and gamma > dcfg.block_size):
        raise UserError(f"--gamma {gamma} must be between 1 and the drafter's block size {dcfg.block_size}")
    if scheduler in ("threshold", "dspark", "dspark-async") and not dcfg.confidence:
        raise UserError(f"--scheduler {scheduler} needs a drafter with a confidence head")
    return scheduler, gamma


def load_speculative(args, target):
    """A function (prompts, sampling, seed) -> SpecResult for the drafter given on the command line."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate

    loaded = load_drafter(args.drafter, target.config, target.name)
    dcfg = loaded.config
    args.scheduler, gamma = drafter_settings(args, dcfg)
    dparams = jax.tree.map(lambda a: jnp.asarray(a, target.config.dtype), loaded.params)
    policy = args.scheduler.replace("-", "_")
    # Every policy but "fixed" verifies fewer tokens than R x (gamma + 1): flatten them into buckets.
    buckets = None
    if policy != "fixed":
        from dspark_jax.engine.sps import token_buckets

        buckets = token_buckets(args.batch_size * (gamma + 1))

    def run(batch, sampling, seed):
        from dspark_jax.generate import pad_prompts

        sps = None
        if policy.startswith("dspark"):  # the round's cost depends on the KV cache this batch gets
            max_len = pad_prompts(target.config, batch, args.max_new_tokens, slack=gamma + 1)[2]
            sps = sps_table(args, target, dcfg, dparams, gamma, max_len, buckets)
        cfg = SpecConfig(gamma=gamma, sampling=sampling, policy=policy, threshold=args.threshold,
                         stop_ids=tuple(target.tokenizer.eos_token_ids), sps=sps, verify_buckets=buckets)
        return speculative_generate(target.params, target.config, dparams, dcfg, batch,
                                    max_new_tokens=args.max_new_tokens, cfg=cfg, temperatures=loaded.sts_temperatures,
                                    seed=seed, progress=not args.json)

    return run


def auto_scheduler(dcfg, batch_size: int) -> str:
    """`--scheduler auto`: fixed without a confidence head; else Algorithm 1 for one request, and
    the asynchronous variant for a batch, where Algorithm 1's early stop meets bucket cliffs (every
    request's anchor fills a bucket exactly, so the first draft token pads the pass to the next) and
    verifies nothing (docs/results.md section 6: 27-30% behind MTP-1 at 16 and 64 requests)."""
    if not dcfg.confidence:
        return "fixed"
    return "dspark" if batch_size == 1 else "dspark-async"


_TABLES: dict = {}  # SPS tables this process loaded or profiled, by file: read (or re-measured) once


def sps_table(args, target, dcfg, dparams, gamma, max_len, buckets):
    """Load the SPS table (round cost per verify bucket: the drafter's pass + the target's verify)
    for this device, target, drafter, batch size, gamma and KV-cache length, or profile and save it.
    The cache length matters: attention over a batch runs over the whole cache, so on a small
    target it is a large part of a round (a table profiled at 512 positions overstates what extra
    verify tokens cost at 256)."""
    import os

    from dspark_jax.engine.speculative import profile_verify
    from dspark_jax.engine.sps import device_kind, load_sps_table, save_sps_table
    from dspark_jax.models import decoder

    # The draft cost is part of a round: the table belongs to the drafter's shape as well as the target's.
    # So does the decoder's layer layout: its costs differ (models/decoder.py).
    drafter = f"{dcfg.kind}-{dcfg.num_layers}L-{dcfg.head}-d{dcfg.hidden_size}"
    layout = decoder.layout_of(target.params)
    model = (f"{target.name}:{target.config.num_layers}x{target.config.hidden_size}:{target.config.dtype}:{layout}"
             f"+{drafter}:kv{max_len}")
    path = args.sps_table or os.path.join(".dspark_cache", f"sps_{target.name}_{layout}_{drafter}_"
                                          f"{device_kind().replace(' ', '_')}_b{args.batch_size}_g{gamma}_kv{max_len}.json")
    if path in _TABLES:
        return _TABLES[path]
    if os.path.exists(path) and not args.profile_sps:
        _TABLES[path] = load_sps_table(path, device=device_kind(), model=model, buckets=buckets)
        return _TABLES[path]
    if args.sps_table and not args.profile_sps:
        raise UserError(f"no SPS table at {args.sps_table} (add --profile-sps to measure one)")
    if not args.json:
        print(f"profiling a round (draft + verify) for {len(buckets)} token buckets ...", file=sys.stderr)
    table = profile_verify(target.params, target.config, dcfg, rows=args.batch_size, gamma=gamma, max_len=max_len,
                           model=model, dparams=dparams)
    save_sps_table(path, table)
    _TABLES[path] = table
    return table


def request_stats(result) -> list[dict]:
    """Per request: mean tau (bonus included), rounds, verified draft tokens and, per draft position
    k, how many rounds reached k (tokens 1..k-1 accepted and k verified) and accepted it."""
    import numpy as np

    rows = len(result.token_ids)
    active = np.stack([r["active"] for r in result.rounds]) if result.rounds else np.zeros((0, rows), bool)
    accepted = np.stack([r["accepted"] for r in result.rounds]) if result.rounds else np.zeros((0, rows), int)
    drafted = np.stack([r["num_draft"] for r in result.rounds]) if result.rounds else np.zeros((0, rows), int)
    gamma = result.rounds[0]["confidence_logits"].shape[1] if result.rounds else 0
    out = []
    for i in range(rows):
        a, n = accepted[active[:, i], i], drafted[active[:, i], i]
        k = np.arange(1, gamma + 1)[None, :]
        reached = (n[:, None] >= k) & (a[:, None] >= k - 1)
        out.append({"acceptance_length": round(float(np.mean(a + 1)), 4) if len(a) else 1.0,
                    "rounds": int(len(a)), "verified_tokens": int(n.sum()),
                    "position_reached": reached.sum(0).tolist(),
                    "position_accepted": (reached & (a[:, None] >= k)).sum(0).tolist()})
    return out


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [prompt_text(p) for p in args.prompt]
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise UserError("give at least one --prompt or a --prompts-file")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise UserError(f"prompt {i + 1} is empty")

    from dspark_jax.checkpoints.registry import default_drafter_path, load_target, resolve_target_path
    from dspark_jax.drafters.checkpoint import read_drafter_config
    from dspark_jax.generate import generate
    from dspark_jax.sampling import SamplingConfig

    # Everything that can be checked without the target's weights is checked before they load.
    target_name, _ = resolve_target_path(args.target)
    if args.drafter == "default":
        args.drafter = default_drafter_path(target_name) or "none"
    if args.compare_ar is None:
        args.compare_ar = args.drafter != "none" and not args.json
    args.batch_size = min(args.batch_size, len(prompts))  # no padding rows, and SPS profiled for real rows
    if args.drafter != "none":
        drafter_settings(args, read_drafter_config(args.drafter))  # the drafter's JSON only
    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    speculative = None if args.drafter == "none" else load_speculative(args, target)
    encoded = [tok.encode(t) if args.raw else tok.chat_prompt_ids(t) for t in prompts]
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    for start in range(0, len(prompts), args.batch_size):
        batch = encoded[start: start + args.batch_size]
        plain = lambda: generate(target.params, target.config, batch, max_new_tokens=args.max_new_tokens,  # noqa: E731
                                 sampling=sampling, stop_ids=tok.eos_token_ids, seed=args.seed + start,
                                 progress=not args.json)
        if speculative is None:
            result, stats = plain(), [{} for _ in batch]
        else:
            result = speculative(batch, sampling, args.seed + start)
            stats = request_stats(result)
            if args.compare_ar:
                baseline = plain()
                for s in stats:
                    s["ar_wall_s"] = round(baseline.wall_s, 4)
                    s["speedup"] = round(baseline.wall_s / result.wall_s, 3)
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
                **stats[i],
            }
            if args.json:
                print(json.dumps(record, ensure_ascii=False), flush=True)
            else:
                extra = ""
                if "acceptance_length" in record:
                    extra = f", tau {record['acceptance_length']:.2f}"
                    extra += f", speedup {record['speedup']:.2f}x" if "speedup" in record else ""
                print(f"### {record['prompt']}\n{record['text']}\n"
                      f"[{record['num_tokens']} tokens, {record['wall_s']:.2f} s, "
                      f"{record['tokens_per_s']:.1f} tokens/s{extra}]\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
