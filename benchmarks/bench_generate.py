"""Greedy generation throughput: dspark_jax vs transformers `generate`, same machine, same run.

    python benchmarks/bench_generate.py [--batch-sizes 1,32] [--new-tokens 128] [--repeats 3]
    python benchmarks/bench_generate.py --batch-sizes 1 --new-tokens 64,2048 --repeats 1 --skip-transformers --name generate_length
    python benchmarks/bench_generate.py --target gemma3-270m --name generate_gemma3

Both sides decode the target (default SmolLM2-135M-Instruct; the same GGUF file, dequantised to
fp32) from the same prompts (chat-templated; a base model without a chat template gets the raw
text after its BOS) for exactly --new-tokens tokens (stop tokens ignored, so the work is equal),
after a warm-up run. Repeats alternate between the two so machine noise hits both alike; the table
reports medians. Compilation is excluded from our numbers (reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import products_note, write_results  # noqa: E402


def load_prompts(n: int) -> list[str]:
    from importlib.resources import files

    prompts = []
    sets = ["gsm8k", "humaneval", "arena-hard-v2"]
    rows = {s: (files("dspark_jax") / "prompts" / f"{s}.jsonl").read_text().splitlines() for s in sets}
    i = 0
    while len(prompts) < n:
        for s in sets:
            prompts.append(json.loads(rows[s][i])["turns"][0][:600])
        i += 1
    return prompts[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m", help="a known target name (a GGUF both sides load)")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--new-tokens", default="128", help="comma-separated: one row per batch size and length")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="generate", help="results file name")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="our weights (bfloat16: bf16 weights, fp32 activations on a CPU); transformers stays fp32")
    ap.add_argument("--xla-dot", action="store_true",
                    help="fp32 few-row products through XLA's dot instead of our CPU kernel (DSPARK_CPU_KERNELS=0)")
    args = ap.parse_args()
    if args.xla_dot:
        os.environ["DSPARK_CPU_KERNELS"] = "0"  # read when the first program is traced

    import numpy as np
    import torch
    import transformers

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.engine.generate import generate

    torch.set_num_threads(os.cpu_count())
    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    hf_model = hf_tok = None
    if not args.skip_transformers:
        folder, name = os.path.split(target.path)
        hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        hf_tok.padding_side = "left"
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32).eval()

    rows = []
    cases = [(int(b), int(n)) for b in args.batch_sizes.split(",") for n in args.new_tokens.split(",")]
    for B, new_tokens in cases:
        encoded = [tok.chat_prompt_ids(p) for p in load_prompts(B)]

        def ours():
            r = generate(target.params, target.config, encoded, max_new_tokens=new_tokens)
            return r.wall_s, r.decode_s, r.compile_s, r.token_ids

        def theirs():
            width = max(len(e) for e in encoded)
            ids = torch.tensor([[hf_tok.pad_token_id] * (width - len(e)) + e for e in encoded])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
            t = time.perf_counter()
            with torch.no_grad():
                out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, do_sample=False, pad_token_id=hf_tok.pad_token_id)
            return time.perf_counter() - t, out[:, width:].tolist()

        _, _, compile_s, ours_ids = ours()  # warm-up (compiles)
        if hf_model is not None:
            theirs()
        ours_t, ours_decode, theirs_t = [], [], []
        for _ in range(args.repeats):
            wall, dec, _, _ = ours()
            ours_t.append(wall)
            ours_decode.append(dec)
            if hf_model is not None:
                t, hf_ids = theirs()
                theirs_t.append(t)
        n = B * new_tokens
        row = {"batch": B, "new_tokens": new_tokens, "ours_tokens_per_s": n / statistics.median(ours_t),
               "ours_decode_tokens_per_s": B * (new_tokens - 1) / statistics.median(ours_decode),
               "ours_compile_s": compile_s}
        if hf_model is not None:
            row["transformers_tokens_per_s"] = n / statistics.median(theirs_t)
            row["speedup"] = row["ours_tokens_per_s"] / row["transformers_tokens_per_s"]
            # Greedy agreement: fraction of rows whose first 32 tokens are identical (fp32 vs fp32
            # on different kernels may legitimately diverge late at near-ties).
            row["rows_agreeing_first_32"] = float(np.mean([a[:32] == b[:32] for a, b in zip(ours_ids, hf_ids)]))
        rows.append(row)
        print(json.dumps(row), flush=True)

    md = ["| batch | new tokens | dspark_jax tok/s | (decode only) | transformers tok/s | speedup | greedy rows agreeing (32 tok) |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    def cell(r, key, fmt):  # "-" where transformers was skipped
        return fmt.format(r[key]) if key in r else "-"

    for r in rows:
        md.append(f"| {r['batch']} | {r['new_tokens']} | {r['ours_tokens_per_s']:.1f} | "
                  f"{r['ours_decode_tokens_per_s']:.1f} | {cell(r, 'transformers_tokens_per_s', '{:.1f}')} | "
                  f"{cell(r, 'speedup', '{:.2f}x')} | {cell(r, 'rows_agreeing_first_32', '{:.2f}')} |")
    ours_dtype = "fp32" if args.dtype == "float32" else "bf16 weights with fp32 activations for dspark_jax, fp32 for transformers"
    md.append(f"\n{ours_dtype}, greedy, target {args.target} ({os.path.basename(target.path)}, dequantised to fp32) on both sides; "
              "tokens/s = batch x new tokens / wall time of prefill + decode (median of repeats; "
              "our XLA compile time excluded and listed in the JSON).\n")
    md.append(products_note(args.xla_dot))
    paths = write_results(args.name, {"rows": rows}, "\n".join(md), **({"directory": args.out} if args.out else {}))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
