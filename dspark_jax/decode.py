"""Offline generation: `python -m dspark_jax.decode --prompt "..."` or `--prompts-file FILE.jsonl`.

Prompts are rendered with the target's own chat template (one user turn, or a whole conversation
from a `{"messages": [...]}` line) unless --raw is given, decoded with continuous batching in
--max-batch request slots (a finished request's slot is refilled at once; `--batching static` runs
fixed batches instead), and printed readably or, with --json, as one JSON object per prompt in input
order followed by a summary object. --output FILE.jsonl appends each result as it completes and
makes the same command resumable: prompts already in the file are skipped.

Several processes (the multi-process flags, `dspark_jax.distributed.runtime`) run one decode
together, each started with the same command: with `--layout data` (the default) each decodes its
own share of the prompts on its own devices and process 0 gathers the results; with `--layout
tensor` the target's weights are split over every process's devices and all run the whole batch.
Either way process 0 alone prints, writes --output and reports the summary.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.core.cli import NON_NEGATIVE_INT, POSITIVE_INT, ArgumentParser, flag, run_cli, setting_flag
from dspark_jax.distributed import gather, runtime
from dspark_jax.engine import offline


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET, KNOWN_TARGETS
    from dspark_jax.engine.speculative import SpecConfig
    from dspark_jax.engine.sampling import SamplingConfig

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
    p.add_argument("--plain-steps", default="auto", choices=["auto", "on", "off"],
                   help="run plain target steps instead of rounds while drafts do not pay (measured as decoding "
                        "goes; re-probed now and then; lossless); auto = on with --scheduler auto")
    p.add_argument("--compare-ar", action=argparse.BooleanOptionalAction, default=None,
                   help="also run plain target decoding on the same prompts and report the speedup in the summary "
                        "(default: on for readable output with a drafter, off with --json or --output)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file",
                   help='JSONL, one prompt a line: {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}, '
                        '...]} (a conversation, rendered with the chat template) or {"turns": [...]} (the first turn)')
    p.add_argument("--offset", type=NON_NEGATIVE_INT, default=0,
                   help="skip the first K prompts (--prompt ones, then the file's lines)")
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="decode at most N prompts (after --offset)")
    p.add_argument("--output", default=None,
                   help="JSONL results file: a header with the settings, then each result as it completes (in "
                        "completion order, each with its input `index`); the same command again resumes")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=setting_flag(SamplingConfig, "top_k"), default=0, help="0 = off")
    p.add_argument("--top-p", type=setting_flag(SamplingConfig, "top_p"), default=1.0, help="in (0, 1]; 1 = off")
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--max-batch", type=POSITIVE_INT, default=None,
                   help=f"request slots decoding together (default {offline.DEFAULT_MAX_BATCH})")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=None, help="the old name of --max-batch")
    p.add_argument("--batching", default="continuous", choices=["continuous", "static"],
                   help="continuous: a finished request's slot is refilled at once; static: batches of --max-batch "
                        "prompts in input order, each decoded to its end")
    p.add_argument("--length-groups", action=argparse.BooleanOptionalAction, default=True,
                   help="continuous batching: run prompts grouped by KV-cache length, shortest first (a shorter "
                        "cache makes every step of the group cheaper)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights' dtype; bfloat16 keeps fp32 activations on a CPU and is much faster "
                        "for verify passes and batches on CPUs with AMX or AVX512-BF16 (docs/results.md section 9)")
    p.add_argument("--raw", action="store_true", help="no chat template: the text as the model's tokenizer encodes it by default (with the BOS it adds, e.g. Gemma 3, Llama 3)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt in input order, then a summary object; no progress bar")
    p.add_argument("--layout", default="data", choices=offline.LAYOUTS,
                   help="how several processes (or one process's devices) share the work: data = each process "
                        "decodes its own share of the prompts on one device of its own, process 0 gathers the "
                        "results; tensor = one mesh over every device of every process, the target's weights split "
                        "over it (tensor parallel), every process decoding the whole batch")
    runtime.add_distributed_flags(p)
    return p.parse_args(argv)


def summary_line(s: dict) -> str:
    if not s["decoded"]:
        return f"nothing to decode: all {s['requests']} requests are already in {s['output']}"
    line = (f"{s['decoded']} requests, {s['generated_tokens']} tokens in {s['wall_s']:.2f} s: "
            f"{s['aggregate_tokens_per_s']:.1f} tokens/s aggregate")
    if s.get("processes", 1) > 1:
        line += f" ({s['processes']} processes, {s['layout']} layout)"
    if "mean_acceptance_length" in s:
        line += f", mean tau {s['mean_acceptance_length']:.2f}"
        if s.get("plain_steps"):
            line += f" ({s['rounds']} rounds, {s['plain_steps']} plain steps)"
    if "speedup" in s:
        line += f"; plain decoding {s['ar_aggregate_tokens_per_s']:.1f} tokens/s: speedup {s['speedup']:.2f}x"
    if s["skipped"]:
        line += f" ({s['skipped']} more already in {s['output']})"
    return line


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.initialize(args)  # before anything touches devices
    summary = offline.decode_prompts(args)
    if gather.is_primary():
        print(json.dumps({"summary": summary}, ensure_ascii=False) if args.json else summary_line(summary),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
