"""The drafter shipped in the package for SmolLM2-135M-Instruct: it loads against the real target,
decodes losslessly (greedy == plain greedy, token for token, with the default dspark scheduler) and
is actually useful (mean tau > 1.5 over held-out eval-split prompts of the three domains)."""

import json
import os

import numpy as np
import pytest

from dspark_jax.checkpoints.registry import default_drafter_path, load_target
from dspark_jax.data.splits import get_split
from dspark_jax.drafters.checkpoint import load_drafter
from dspark_jax.engine.sps import SPSTable
from dspark_jax.engine.speculative import SpecConfig, speculative_generate
from dspark_jax.engine.generate import generate


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m")


def test_shipped_drafter_is_compact_and_calibrated():
    path = default_drafter_path("smollm2-135m")
    assert path is not None, "no drafter shipped for smollm2-135m (dspark_jax/shipped/dspark_smollm2-135m)"
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size < 50e6
    meta = json.load(open(os.path.join(path, "drafter.json")))
    assert meta["storage_dtype"] == "bfloat16"
    assert meta["config"]["kind"] == "dspark" and meta["config"]["confidence"]
    assert meta["sts_temperatures"] and len(meta["sts_temperatures"]) == meta["config"]["block_size"]


def test_shipped_drafter_is_lossless_and_accepts_more_than_one_token(smollm2):
    loaded = load_drafter(default_drafter_path("smollm2-135m"), smollm2.config, smollm2.name)
    dparams = loaded.decoding_params(smollm2)
    tok = smollm2.tokenizer
    # Held-out prompts (eval split, never trained or calibrated on), one per domain: math, code, chat
    # (a round of 3 rows costs half one of 6 here: the verify pass is compute-bound on a CPU).
    prompts = [tok.chat_prompt_ids(get_split(name, "eval")[0]) for name in ("gsm8k", "mbpp", "arena-hard-v2")]
    gamma, rows = loaded.config.block_size, len(prompts)
    # A made-up SPS table (flat, then falling): the scheduler's choices vary, the output must not.
    # Three buckets (a verify program each, ~5 s to compile), not token_buckets' seven.
    buckets = tuple(rows * (gamma + 1) // d for d in (4, 2, 1))
    sps = SPSTable(buckets=buckets, sps=tuple(40.0 / (1 + max(0, b - 8) / 8) for b in buckets))
    cfg = SpecConfig(gamma=gamma, policy="dspark", sps=sps, verify_buckets=buckets,
                     stop_ids=tuple(tok.eos_token_ids))
    want = generate(smollm2.params, smollm2.config, prompts, max_new_tokens=64, stop_ids=tok.eos_token_ids)
    got = speculative_generate(smollm2.params, smollm2.config, dparams, loaded.config, prompts, max_new_tokens=64,
                               cfg=cfg, temperatures=loaded.sts_for(0.0))
    assert got.token_ids == want.token_ids
    fixed = speculative_generate(smollm2.params, smollm2.config, dparams, loaded.config, prompts, max_new_tokens=64,
                                 cfg=SpecConfig(gamma=gamma, stop_ids=tuple(tok.eos_token_ids)))
    assert fixed.token_ids == want.token_ids
    tau = fixed.acceptance_lengths()
    assert np.mean(tau) > 1.5, np.mean(tau)
