"""What a draft vocabulary costs a trained drafter in held-out acceptance (DESIGN.md 2.7).

    python benchmarks/bench_draft_vocab.py [--drafter dspark_jax/shipped/dspark_smollm2-135m] [--sizes 0,8192,16384]
        [--data datasets/smollm2-135m/train] [--held-out datasets/smollm2-135m/eval] [--eval-batches 16]

For each N (0: the whole vocabulary) the drafter is given the N most frequent response tokens of
--data (`python -m dspark_jax.draft_vocab`, weights unchanged) and scored as a training sitting scores
it: teacher-forced expected tau and per-position acceptance (T = 1, sum_x min(p, q)) on the same
--eval-batches held-out batches of --held-out, with the coverage of those responses' tokens. Greedy
decoding's tau is measured by `python -m dspark_jax.eval` over the drafter folders instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import int_list, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", default="dspark_jax/shipped/dspark_smollm2-135m")
    ap.add_argument("--config", default="configs/dspark_smollm2-135m.yaml", help="the drafter's training config")
    ap.add_argument("--sizes", type=int_list, default=[0, 8192, 16384])
    ap.add_argument("--data", default="datasets/smollm2-135m/train")
    ap.add_argument("--held-out", default="datasets/smollm2-135m/eval")
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--name", default="draft_vocab")
    args = ap.parse_args()

    import jax
    import numpy as np

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.training import draft_vocab
    from dspark_jax.training.config import load_config
    from dspark_jax.training.trainer import Trainer

    loaded = load_drafter(args.drafter)
    target = load_target(loaded.config.target_name)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for n in args.sizes:
            folder = os.path.join(work, f"v{n}")
            draft_vocab.save_loaded(draft_vocab.with_draft_vocabulary(loaded, args.data, n), folder, {})
            cfg = load_config(args.config, [f"optim.init_from_drafter={folder}", f"data.train_dir={args.data}",
                                            f"data.eval_dir={args.held_out}", f"run.eval_batches={args.eval_batches}",
                                            "data.seq_len=1024", "data.rows=4", "data.blocks_per_row=64",
                                            "data.feature_cache=null", f"run.out_dir={work}/run"])
            trainer = Trainer(cfg, target, progress=False)
            params = jax.tree.map(np.asarray, jax.device_get(trainer.init_state().params))
            scores = trainer.evaluate(params)
            trainer.close()
            coverage = (draft_vocab.coverage_table(args.data, args.held_out, [n], loaded.config.vocab_size)[0]
                        if n else draft_vocab.Coverage(0, 1.0, 1.0))
            rows.append({**dataclasses.asdict(coverage), "expected_tau": scores["eval_expected_tau"],
                         "acceptance_per_position": scores["eval_acceptance_per_position"]})
            print(rows[-1], flush=True)

    whole = rows[0]["expected_tau"] if rows[0]["size"] == 0 else None
    md = ["| draft vocabulary | held-out coverage | expected tau (T = 1) | vs whole | acceptance at k = 1..7 |",
          "|---|---:|---:|---:|---|"]
    for r in rows:
        gain = f"{100 * (r['expected_tau'] / whole - 1):+.2f}%" if whole else "-"
        md.append(f"| {r['size'] or 'whole'} | {100 * r['held_out']:.2f}% | {r['expected_tau']:.4f} | {gain} | "
                  + " ".join(f"{a:.3f}" for a in r["acceptance_per_position"]) + " |")
    md.append(f"\n{args.drafter}, teacher-forced on the first {args.eval_batches} held-out batches of "
              f"{args.held_out} (4 rows of 1,024 tokens, 64 blocks a row), vocabularies from {args.data}.\n")
    print("wrote", *write_results(args.name, {"rows": rows, "drafter": args.drafter}, "\n".join(md)))


if __name__ == "__main__":
    main()
