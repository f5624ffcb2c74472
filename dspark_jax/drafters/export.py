"""Export one of our drafter folders to a serving layout (today: DeepSpec's, read by vLLM / SGLang).

This is where a drafter folder, its target and a layout writer meet; the layout itself (names,
config fields, checks) lives in `drafters.deepspec`.
"""

from __future__ import annotations

import os

from dspark_jax.checkpoints.hf import load_hf_model, read_json
from dspark_jax.checkpoints import registry
from dspark_jax.core.errors import UserError
from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config
from dspark_jax.drafters.deepspec import EXPORT_DTYPES, check_exportable, check_out_dir, save_deepspec_drafter


def export_drafter(drafter_dir: str, out_dir: str, target: str | None = None, dtype: str = "bfloat16",
                   overwrite: bool = False) -> dict:
    """Our drafter folder (drafter.json + drafter.safetensors) -> a DeepSpec-layout folder. The
    target (`target` or the one the drafter records) supplies the embedding / LM head copies and
    the config fields; everything cheap is checked before it is loaded."""
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unsupported export dtype {dtype!r} (one of {', '.join(EXPORT_DTYPES)})")
    check_out_dir(out_dir, overwrite, source=drafter_dir)
    draft_vocab_size = read_drafter_config(drafter_dir).draft_vocab_size
    check_exportable(whole_vocabulary(read_drafter_config(drafter_dir)))  # before any weights, the target's above all
    spec = target or read_drafter_config(drafter_dir).target_name
    if not spec:
        raise UserError(f"{drafter_dir}: the drafter records no target; pass --target NAME_OR_PATH")
    name, path = registry.resolve_target_path(spec)
    drafter = load_drafter(drafter_dir)  # its weights checked against its config
    if os.path.isdir(path):  # a Hugging Face folder: its config.json is the base; no tokenizer needed
        target_json = read_json(os.path.join(path, "config.json"))
        target_cfg, target_params = load_hf_model(path)
        tokenizer = None
    else:  # a known name or a GGUF file: config fields from its shape and tokenizer
        tgt = registry.load_target(spec, layout="stacked")
        target_json, target_cfg, target_params, tokenizer = None, tgt.config, tgt.params, tgt.tokenizer
    drafter.config.check_target(target_cfg, name)
    dcfg = whole_vocabulary(drafter.config if drafter.config.target_name else drafter.config.replace(target_name=name))
    summary = save_deepspec_drafter(
        out_dir, dcfg, drafter.params, target_cfg, target_params, target_json=target_json, tokenizer=tokenizer,
        dtype=dtype, sts_temperatures=drafter.sts_temperatures, training=_training_values(drafter.metadata),
        overwrite=overwrite, side={"exported_from": {"drafter": os.path.abspath(drafter_dir), "target": spec},
              "sts_by_temperature": {f"{t:g}": list(v) for t, v in sorted(drafter.sts_by_temperature.items())}})
    summary["target"] = spec
    summary["notes"] = [] if target_json is not None else [
        f"the target {spec} is a GGUF file: the embedding / LM head copies are its (dequantised) weights "
        "and config.json is made from its shape; to serve, export against the Hugging Face folder of the "
        "target you serve (--target DIR)"]
    if draft_vocab_size:
        summary["notes"].append(
            f"the drafter's {draft_vocab_size}-token draft vocabulary is not exported (no draft-to-target map, "
            "d2t, is written): the folder drafts over the target's whole vocabulary, as SGLang's DSpark and "
            "sglang-jax expect (docs/serving.md)")
    return summary


def whole_vocabulary(dcfg):
    """The drafter drafting over the target's whole vocabulary: what the export writes. The weights
    are the same (a draft vocabulary is a choice of the target head's and the Markov table's rows)."""
    return dcfg.replace(draft_vocab_size=0, draft_vocab=())


def _training_values(metadata: dict) -> dict:
    """Training-only values the reference's config requires, from our training metadata."""
    data = (metadata.get("train_config") or {}).get("data") or {} if isinstance(metadata, dict) else {}
    anchors = data.get("anchors_per_seq") if isinstance(data, dict) else None
    return {"num_anchors": anchors} if isinstance(anchors, int) and anchors > 0 else {}
