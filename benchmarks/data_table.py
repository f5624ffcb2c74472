"""What a training data folder holds, per datagen run and prompt set: prompts, responses, tokens.

    python benchmarks/data_table.py data/smollm2-train data/smollm2-eval [--name data] [--out DIR]

Each argument is a datagen folder or a folder of them (as `data.train_dir` takes). Per run: its
sampling, how many of its planned prompts are done, truncated prompts, response tokens (mean and
share that ended with a stop token); per prompt set over all runs. Writes <name>.md and <name>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results  # noqa: E402


def datagen_folders(folder: str) -> list[str]:
    from dspark_jax.data.shards import MANIFEST

    if os.path.exists(os.path.join(folder, MANIFEST)):
        return [folder]
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if os.path.exists(os.path.join(folder, n, MANIFEST))]


def describe(folder: str) -> dict:
    from dspark_jax.data.shards import read_manifest, read_shard

    m = read_manifest(folder)
    per_set: dict[str, dict] = {}
    for entry in m["shards"]:
        data = read_shard(os.path.join(folder, entry["file"]))
        lengths = np.diff(data["offsets"]) - data["prompt_lens"]
        for k, example in enumerate(data["example_ids"]):
            s = per_set.setdefault(str(example).split("/")[0], dict(responses=0, response_tokens=0, prompt_tokens=0,
                                                                     finished=0))
            s["responses"] += 1
            s["response_tokens"] += int(lengths[k])
            s["prompt_tokens"] += int(data["prompt_lens"][k])
            s["finished"] += int(data["finished"][k])
    sampling = m["sampling"]
    label = "greedy" if sampling["temperature"] == 0 else (f"T {sampling['temperature']}, top-p {sampling['top_p']}, "
                                                          f"top-k {sampling['top_k']}, seed {m['seed']}")
    return {"folder": folder, "sampling": label, "split": m["split"], "max_new_tokens": m["max_new_tokens"],
            "done": m["num_examples"], "planned": m["num_planned"], "complete": m["complete"],
            "truncated": sum(c.get("truncated", 0) for c in m["counts"].values()),
            "response_tokens": m["response_tokens"], "per_set": per_set}


def describe_split(folder: str) -> str:
    from dspark_jax.data.shards import read_manifest

    return read_manifest(folder)["split"]


def draft_vocab_coverage(train: list[str], held_out: list[str],
                         sizes=(1024, 2048, 4096, 8192, 16384, 32768)) -> dict[str, dict[int, float]]:
    """{"train": {N: share}, "eval": {N: share}}: the share of the train (and held-out) response
    tokens that the N most frequent train response tokens cover (`data.pipeline.draft_vocabulary`)."""
    if not train:
        return {}
    from dspark_jax.data.shards import read_manifest
    from dspark_jax.data.pipeline import ShardSource, draft_vocabulary, vocabulary_coverage

    source = ShardSource(train)
    vocab = read_manifest(train[0])["target_shape"]["vocab_size"]
    picked = {n: draft_vocabulary(source, n, vocab) for n in sizes if n < vocab}
    out = {"train": {n: share for n, (_, share) in picked.items()}}
    if held_out:
        held_out_source = ShardSource(held_out)
        out["eval"] = {n: vocabulary_coverage(held_out_source, ids, vocab) for n, (ids, _) in picked.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--name", default="data")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    runs = [describe(f) for folder in args.folders for f in datagen_folders(folder)]
    if not runs:
        sys.exit("error: no datagen folders in " + ", ".join(args.folders))
    md = ["| run | split | responses | prompts done / planned | prompts truncated (plan) | response tokens | "
          "mean response | ended by a stop token |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        n = sum(s["responses"] for s in r["per_set"].values())
        fin = sum(s["finished"] for s in r["per_set"].values())
        md.append(f"| `{r['folder']}` | {r['split']} | {r['sampling']}, <= {r['max_new_tokens']} new | "
                  f"{r['done']} / {r['planned']} | {r['truncated']} | {r['response_tokens']:,} | "
                  f"{r['response_tokens'] / max(n, 1):.0f} | {100 * fin / max(n, 1):.0f}% |")
    for split in sorted({r["split"] for r in runs}):
        md += ["", f"Per prompt set, {split} split, all runs:", "",
               "| set | responses | response tokens | prompt tokens |", "|---|---:|---:|---:|"]
        sets: dict[str, dict] = {}
        for r in (r for r in runs if r["split"] == split):
            for name, s in r["per_set"].items():
                t = sets.setdefault(name, dict(responses=0, response_tokens=0, prompt_tokens=0))
                for k in t:
                    t[k] += s[k]
        for name, t in sets.items():
            md.append(f"| {name} | {t['responses']:,} | {t['response_tokens']:,} | {t['prompt_tokens']:,} |")
        md.append(f"| all | {sum(t['responses'] for t in sets.values()):,} | "
                  f"{sum(t['response_tokens'] for t in sets.values()):,} | "
                  f"{sum(t['prompt_tokens'] for t in sets.values()):,} |")
    folders = [f for folder in args.folders for f in datagen_folders(folder)]
    coverage = draft_vocab_coverage([f for f in folders if describe_split(f) == "train"],
                                    [f for f in folders if describe_split(f) == "eval"])
    if coverage:
        sizes = list(coverage["train"])
        md += ["", "Draft vocabulary: share of response tokens that the N most frequent train response tokens "
               "cover (`drafter.draft_vocab_size`):", "", "| N | " + " | ".join(f"{n:,}" for n in sizes) + " |",
               "|---|" + "---:|" * len(sizes)]
        md += [f"| {split} responses | " + " | ".join(f"{100 * c:.3f}%" for c in shares.values()) + " |"
               for split, shares in coverage.items()]
    paths = write_results(args.name, {"runs": runs, "draft_vocab_coverage": coverage}, "\n".join(md) + "\n", **({"directory": args.out} if args.out else {}))
    print("\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
