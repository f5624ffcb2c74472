"""Drafter configuration: one frozen dataclass for DSpark (Markov / RNN head), DFlash (head off)
and Eagle3, plus the identity of the target the drafter belongs to."""

from __future__ import annotations

import dataclasses

from dspark_jax.core.config_checks import relation, setting, validate
from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig, RopeScaling

KINDS = ("dspark", "eagle3")
HEADS = ("markov", "rnn", "none")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    kind: str = setting(choices=KINDS)  # "dspark" (DFlash = dspark with head="none", confidence=False) | "eagle3"
    # Draft decoder layers (shaped like a Qwen3 layer: RMSNorm, q/k-norm attention with RoPE, SwiGLU).
    num_layers: int = setting(ge=1)
    hidden_size: int = setting(ge=1)
    num_heads: int = setting(ge=1)
    num_kv_heads: int = setting(ge=1)
    head_dim: int = setting(ge=2)
    intermediate_size: int = setting(ge=1)
    vocab_size: int = setting(ge=1)
    rms_norm_eps: float = setting(1e-6, gt=0)
    rope_theta: float = setting(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = setting(4096, ge=1)
    qk_norm: bool = True
    # Target taps: DeepSpec's 0-based decoder-layer ids; our decoder's tap index is id + 1
    # (the residual stream AFTER that layer, Hugging Face's hidden_states[id + 1]).
    target_layer_ids: tuple[int, ...] = setting((), ge=-1)  # -1 = the embeddings (DeepSpec)
    # DSpark / DFlash
    block_size: int = setting(7, ge=1)  # gamma: draft slots per block (slot 0 holds the anchor)
    mask_token_id: int | None = setting(None, ge=0)  # embedding of this target token id fills the MASK slots
    head: str = setting("markov", choices=HEADS)  # sequential head: "markov" | "rnn" | "none"
    markov_rank: int = setting(0, ge=0)  # r; 0 with head="none" is DFlash
    confidence: bool = True
    confidence_with_markov: bool = True  # confidence input [h; W1[prev]] (else h alone)
    # Draft vocabulary: the drafter scores only these target token ids (sorted), so its LM head
    # costs draft_vocab_size / vocab_size of the target's; every other token has draft probability
    # exactly zero, which keeps rejection sampling lossless. draft_vocab_size = 0: the whole
    # vocabulary. Training fills `draft_vocab` with the most frequent response tokens of its data.
    draft_vocab_size: int = setting(0, ge=0)
    draft_vocab: tuple[int, ...] = setting((), ge=0)
    # Eagle3
    ttt_steps: int = setting(7, ge=1)  # training-time-test unroll length
    ttt_decay: float = setting(0.8, gt=0)  # step loss weights decay**i
    # Supervise the TTT passes only at the training pipeline's anchors (the chain from anchor p
    # predicts the same gamma tokens as a DSpark block at p) instead of at every position: the same
    # supervised predictions per step as the block drafters, and ~1/(anchor density) the LM-head cost.
    ttt_at_anchors: bool = False
    # The target this drafter belongs to (checked at load time; 0 = not recorded).
    target_name: str = ""
    target_vocab_size: int = setting(0, ge=0)
    target_hidden_size: int = setting(0, ge=0)
    target_num_layers: int = setting(0, ge=0)
    # The target's embedding scale (Gemma: sqrt(hidden)): the drafter embeds tokens as the target does.
    target_embed_scale: float = setting(1.0, gt=0)

    __relations__ = (
        relation("markov_rank head", lambda markov_rank, head: head == "none" or markov_rank > 0,
                 "markov_rank must be at least 1 with head={head!r} (head 'none' has no Markov table)"),
        relation("num_heads num_kv_heads", lambda num_heads, num_kv_heads: num_heads % num_kv_heads == 0,
                 "num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"),
        relation("head_dim", lambda head_dim: head_dim % 2 == 0, "head_dim must be even (RoPE), got {head_dim}"),
        relation("mask_token_id vocab_size",
                 lambda mask_token_id, vocab_size: mask_token_id is None or mask_token_id < vocab_size,
                 "mask_token_id={mask_token_id} is not a token id of the vocabulary ({vocab_size} tokens)"),
        relation("draft_vocab_size vocab_size", lambda draft_vocab_size, vocab_size: draft_vocab_size < vocab_size,
                 "draft_vocab_size={draft_vocab_size} must be below the vocabulary's {vocab_size} tokens "
                 "(0 drafts over all of them)"),
        relation("draft_vocab draft_vocab_size vocab_size",
                 lambda draft_vocab, draft_vocab_size, vocab_size: not draft_vocab or (
                     len(draft_vocab) == draft_vocab_size and list(draft_vocab) == sorted(set(draft_vocab))
                     and draft_vocab[-1] < vocab_size),
                 "draft_vocab must hold draft_vocab_size={draft_vocab_size} distinct token ids below "
                 "{vocab_size}, sorted"),
        relation("draft_vocab_size kind", lambda draft_vocab_size, kind: not draft_vocab_size or kind == "dspark",
                 "a draft vocabulary is for DSpark/DFlash drafters (kind {kind!r})"),
        relation("target_layer_ids target_num_layers",
                 lambda target_layer_ids, target_num_layers: not target_num_layers
                 or all(i < target_num_layers for i in target_layer_ids),
                 "target_layer_ids {target_layer_ids} must be below the target's {target_num_layers} layers"),
    )

    def __post_init__(self):
        validate(self)
        # A config is a static argument of every jitted drafter function: hash its (up to ~10^4
        # draft vocabulary ids) once, not at every call.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Tap indices for `decoder.forward(..., tap_layers=...)`."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def uses_markov_table(self) -> bool:
        return self.head != "none" and self.markov_rank > 0

    def layer_config(self) -> ModelConfig:
        """The draft layers as a decoder ModelConfig, so `decoder.decoder_layer` and friends serve them."""
        return ModelConfig(
            family="qwen3" if self.qk_norm else "llama", vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling, qk_norm=self.qk_norm)

    def check_target(self, target: ModelConfig, target_name: str = "") -> None:
        """A drafter used with a target it was not trained for is a clear error, not a shape crash."""
        want = (self.target_vocab_size, self.target_hidden_size, self.target_num_layers)
        have = (target.vocab_size, target.hidden_size, target.num_layers)
        if want != have:
            raise UserError(
                f"drafter was trained for target {self.target_name or '?'} (vocab {want[0]}, hidden {want[1]}, "
                f"{want[2]} layers) but the target {target_name or ''} has vocab {have[0]}, hidden {have[1]}, "
                f"{have[2]} layers")
        if max(self.tap_layers, default=0) > target.num_layers:
            raise UserError(f"drafter taps target layers {self.target_layer_ids}, target has {target.num_layers}")

    def replace(self, **kw) -> "DrafterConfig":
        return dataclasses.replace(self, **kw)
