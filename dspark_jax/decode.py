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

import json
import sys

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, add_settings, run_cli, settings_from
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather, runtime
from dspark_jax.distributed.runtime import ProcessSettings
from dspark_jax.engine import offline
from dspark_jax.engine.decode_settings import DecodeSettings


def parse_args(argv: list[str] | None) -> tuple[DecodeSettings, ProcessSettings]:
    """The run's settings from the command line (each flag's type, range, default and help are its
    DecodeSettings field's) and how this process joins a multi-process run."""
    p = ArgumentParser(prog="python -m dspark_jax.decode", description=__doc__.split("\n")[0])
    add_settings(p, DecodeSettings)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=None, help="the old name of --max-batch")
    add_settings(p, ProcessSettings)
    args = p.parse_args(argv)
    if args.batch_size is not None:
        if args.max_batch not in (None, args.batch_size):
            raise UserError("--batch-size is the old name of --max-batch: give one of them")
        args.max_batch = args.batch_size
    return settings_from(DecodeSettings, args), settings_from(ProcessSettings, args)


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


def compile_check(settings: DecodeSettings) -> int:
    """--compile-for: the engine's programs compiled for a TPU slice; nothing is decoded."""
    from dspark_jax.serving.tpu_compile import format_reports
    from dspark_jax.training.compile_check import decode_check

    reports, tpu, about = decode_check(settings)
    if settings.json:
        print(json.dumps({"compiled": about, "programs": [r.as_dict() for r in reports]}))
    else:
        print(f"{about['target']} ({about['target_shapes']}) with {about['drafter']}, {about['rows']} request slots, "
              f"{about['prompt_tokens']} + {about['max_new_tokens']} tokens, {about['dtype']}, scheduler "
              f"{about['scheduler']}, gamma {about['gamma']}")
        print(format_reports(reports, tpu))
    return 0 if all(r.fits for r in reports) else 1


@run_cli
def main(argv: list[str] | None = None) -> int:
    settings, processes = parse_args(argv)
    if settings.compile_for:
        return compile_check(settings)
    runtime.initialize(processes)  # before anything touches devices
    summary = offline.decode_prompts(settings)
    if gather.is_primary():
        print(json.dumps({"summary": summary}, ensure_ascii=False) if settings.json else summary_line(summary),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
