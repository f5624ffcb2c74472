"""The settings of an offline decode run (`python -m dspark_jax.decode`, `engine.offline`): one
frozen value, each field typed, ranged and documented once (its `doc` is the flag's help), built
from the command line by the entry point, or directly by `eval`, the benchmarks and the notebooks.

`resolve` settles what the flags leave open (the request slots for the prompts at hand, the default
drafter, the scheduler and gamma the drafter allows, plain steps, --compare-ar) before any weights
load, and returns the settings the run then uses. Importing this module costs no JAX.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.checkpoints.known_targets import DEFAULT_TARGET, KNOWN_TARGETS
from dspark_jax.core.config_checks import setting, validate
from dspark_jax.core.errors import UserError

DEFAULT_MAX_BATCH = 8
SCHEDULERS = ("auto", "fixed", "mtp1", "threshold", "dspark", "dspark-async")
LAYOUTS = ("data", "tensor")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    # ---- the requests
    prompt: tuple[str, ...] = setting((), doc="a prompt (repeatable)")
    prompts_file: str | None = setting(
        None, doc='JSONL, one prompt a line: {"prompt": "..."}, {"messages": [{"role": ..., "content": ...}, ...]} '
                  '(a conversation, rendered with the chat template) or {"turns": [...]} (the first turn)')
    offset: int = setting(0, ge=0, doc="skip the first K prompts (--prompt ones, then the file's lines)")
    limit: int | None = setting(None, ge=1, doc="decode at most N prompts (after --offset)")
    raw: bool = setting(False, doc="no chat template: the text as the model's tokenizer encodes it by default (with "
                                   "the BOS it adds, e.g. Gemma 3, Llama 3)")
    # ---- the models
    target: str = setting(DEFAULT_TARGET,
                          doc=f"known name ({', '.join(KNOWN_TARGETS)}), Hugging Face folder or .gguf file")
    drafter: str = setting("default", doc="drafter checkpoint folder; 'default' = the drafter shipped for the target "
                                          "(plain decoding if there is none); 'none' = plain target decoding")
    dtype: str = setting("float32", choices=("float32", "bfloat16"),
                         doc="weights' dtype; bfloat16 keeps fp32 activations on a CPU and is much faster for verify "
                             "passes and batches on CPUs with AMX or AVX512-BF16 (docs/results.md section 9)")
    # ---- speculative decoding
    scheduler: str = setting("auto", choices=SCHEDULERS,
                             doc="draft tokens verified per request and round (docs/decoding.md); auto = dspark with "
                                 "a confidence head, else fixed")
    gamma: int | None = setting(None, ge=1, doc="draft tokens per round, 1 to the drafter's block size (default: the "
                                                "block size)")
    threshold: float = setting(0.5, ge=0, le=1, doc="prefix-survival threshold in [0, 1] for --scheduler threshold")
    plain_steps: str = setting("auto", choices=("auto", "on", "off"),
                               doc="run plain target steps instead of rounds while drafts do not pay (measured as "
                                   "decoding goes; re-probed now and then; lossless); auto = on with --scheduler auto")
    sps_table: str | None = setting(None, doc="SPS table JSON for the dspark schedulers (default: .dspark_cache/, "
                                              "profiled when missing)")
    profile_sps: bool = setting(False, doc="re-profile the SPS table even if one exists")
    # ---- sampling
    max_new_tokens: int = setting(128, ge=1, doc="tokens to generate per prompt at most")
    temperature: float = setting(0.0, ge=0, doc="0 = greedy")
    top_k: int = setting(0, ge=0, doc="0 = off")
    top_p: float = setting(1.0, gt=0, le=1, doc="in (0, 1]; 1 = off")
    seed: int = setting(0, ge=0, lt=2**32, doc="random seed of the sampling")
    # ---- batching and processes
    max_batch: int | None = setting(None, ge=1, doc=f"request slots decoding together (default {DEFAULT_MAX_BATCH})")
    batching: str = setting("continuous", choices=("continuous", "static"),
                            doc="continuous: a finished request's slot is refilled at once; static: batches of "
                                "--max-batch prompts in input order, each decoded to its end")
    length_groups: bool = setting(True, doc="continuous batching: run prompts grouped by KV-cache length, shortest "
                                            "first (a shorter cache makes every step of the group cheaper)")
    layout: str = setting("data", choices=LAYOUTS,
                          doc="how several processes (or one process's devices) share the work: data = each process "
                              "decodes its own share of the prompts on one device of its own, process 0 gathers the "
                              "results; tensor = one mesh over every device of every process, the target's weights "
                              "split over it (tensor parallel), every process decoding the whole batch")
    # ---- output
    output: str | None = setting(None, doc="JSONL results file: a header with the settings, then each result as it "
                                           "completes (in completion order, each with its input `index`); the same "
                                           "command again resumes")
    json: bool = setting(False, doc="one JSON object per prompt in input order, then a summary object; no progress "
                                    "bar")
    compare_ar: bool | None = setting(None, doc="also run plain target decoding on the same prompts and report the "
                                                "speedup in the summary (default: on for readable output with a "
                                                "drafter, off with --json or --output)")

    # ---- the TPU compile check (decodes nothing)
    compile_for: str | None = setting(
        None, metavar="ACCELERATOR_TYPE",
        doc="compile the engine's programs for this Cloud TPU slice (e.g. v5e-8, v6e-8, v5p-8) from the target's "
            "and the drafter's shapes alone (no weights; libtpu needed, JAX_PLATFORMS=cpu) and print, per program "
            "and chip, the compiler's memory against HBM, its collectives, flops, HBM bytes and roofline time; "
            "--drafter may then also be a training config (configs/*.yaml), --target a config.json folder or a "
            "known name (qwen3-8b)")
    compile_prompt_tokens: int = setting(1024, ge=1, doc="--compile-for: each request's prompt tokens (its KV cache "
                                                         "holds them and --max-new-tokens)")

    def __post_init__(self):
        validate(self)


def auto_scheduler(dcfg, max_batch: int) -> str:
    """`--scheduler auto`: fixed without a confidence head; else Algorithm 1 for one request, and
    the asynchronous variant for a batch, where Algorithm 1's early stop meets bucket cliffs (every
    request's anchor fills a bucket exactly, so the first draft token pads the pass to the next) and
    verifies nothing (docs/results.md section 6: 27-30% behind MTP-1 at 16 and 64 requests)."""
    if not dcfg.confidence:
        return "fixed"
    return "dspark" if max_batch == 1 else "dspark-async"


def with_drafter(settings: DecodeSettings, dcfg) -> DecodeSettings:
    """The settings for this drafter (its config `dcfg`): `--scheduler auto` resolved, --gamma
    defaulted to its block size, plain steps on or off, each checked against what the drafter has
    (its block size, a confidence head). Settings already resolved come back unchanged."""
    scheduler = (auto_scheduler(dcfg, settings.max_batch or DEFAULT_MAX_BATCH) if settings.scheduler == "auto"
                 else settings.scheduler)
    gamma = settings.gamma or dcfg.block_size
    if gamma < 1 or (dcfg.kind == "dspark" and gamma > dcfg.block_size):
        raise UserError(f"--gamma {gamma} must be between 1 and the drafter's block size {dcfg.block_size}")
    if scheduler in ("threshold", "dspark", "dspark-async") and not dcfg.confidence:
        raise UserError(f"--scheduler {scheduler} needs a drafter with a confidence head")
    plain_steps = settings.plain_steps
    if plain_steps == "auto":
        plain_steps = "on" if settings.scheduler == "auto" else "off"
    return dataclasses.replace(settings, scheduler=scheduler, gamma=gamma, plain_steps=plain_steps)


def resolve(settings: DecodeSettings, count: int) -> tuple[DecodeSettings, str]:
    """(the settings this run uses, the target's name) for `count` requests, checking what can be
    checked without the target's weights: the request slots (at most `count`, so no padding rows,
    and the SPS table and `auto` scheduler are for the rows really decoding), the default drafter,
    --compare-ar, and the scheduler and gamma (from the drafter's JSON)."""
    from dspark_jax.checkpoints.registry import default_drafter_path, resolve_target_path
    from dspark_jax.drafters.checkpoint import read_drafter_config

    target_name, _ = resolve_target_path(settings.target)
    drafter = settings.drafter
    if drafter == "default":
        drafter = default_drafter_path(target_name) or "none"
    compare_ar = settings.compare_ar
    if compare_ar is None:
        compare_ar = drafter != "none" and not settings.json and not settings.output
    out = dataclasses.replace(settings, max_batch=min(settings.max_batch or DEFAULT_MAX_BATCH, count), drafter=drafter,
                              compare_ar=compare_ar)
    if drafter != "none":
        out = with_drafter(out, read_drafter_config(drafter))
    return out, target_name
