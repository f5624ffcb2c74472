"""Export a drafter trained here to the reference implementation's (DeepSpec's) checkpoint layout.

    python -m dspark_jax.export --drafter DIR --format deepspec --out DIR [--dtype bfloat16|float32]
                                [--target NAME_OR_PATH] [--overwrite]

DIR is one of our drafter folders (drafter.json + drafter.safetensors: a training run's
`drafter/`, or a shipped one such as dspark_jax/shipped/dspark_smollm2-135m). The output folder
(config.json, model.safetensors, dspark_sts.json) is what vLLM / SGLang load for DeepSpec drafters;
see docs/serving.md. --target (default: the target the drafter records) supplies the embedding /
LM head copies and the target's config fields: give the Hugging Face folder of the target you
will serve. The writer is `dspark_jax.drafters.export.export_drafter`.
"""

from __future__ import annotations

from dspark_jax.core.cli import ArgumentParser, run_cli

FORMATS = ("deepspec",)


def parse_args(argv: list[str] | None):
    from dspark_jax.drafters.deepspec import EXPORT_DTYPES

    p = ArgumentParser(prog="python -m dspark_jax.export", description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="our drafter folder (drafter.json + drafter.safetensors)")
    p.add_argument("--format", required=True, choices=FORMATS, help="output layout")
    p.add_argument("--out", required=True, help="output folder (new or empty; see --overwrite)")
    p.add_argument("--dtype", default="bfloat16", choices=EXPORT_DTYPES, help="storage dtype (default bfloat16)")
    p.add_argument("--target", default=None,
                   help="target name, Hugging Face folder or .gguf file (default: the drafter's own target)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return p.parse_args(argv)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dspark_jax.drafters.export import export_drafter

    summary = export_drafter(args.drafter, args.out, target=args.target, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {summary['out']}: {summary['architecture']}, {summary['tensors']} tensors, "
          f"{summary['bytes'] / 2**20:.1f} MiB {summary['dtype']} (target {summary['target']})")
    print(f"files: {', '.join(summary['files'])}")
    if summary["outside_layout"]:
        print("kept in the side file (no field in the layout): "
              + ", ".join(f"{k}={v}" for k, v in summary["outside_layout"].items()))
    for note in summary["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
