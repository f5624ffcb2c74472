"""Text <-> token ids and chat prompts, from a Hugging Face folder or from a GGUF file's metadata.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer) plus the model's chat
template. Chat templates are rendered with jinja2 in the same environment transformers uses
(sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that does not escape HTML,
`raise_exception` / `strftime_now` globals, the special tokens as variables), so that the prompt
string is byte-identical to `tokenizer.apply_chat_template(..., tokenize=False)`.

GGUF files carry no tokenizer.json, only the vocabulary, the merges, token types and the name of
llama.cpp's pre-tokenizer (`tokenizer.ggml.pre`); `_GGUF_PRE_TOKENIZERS` rebuilds the original
model's pipeline for each name we support. Where transformers' own GGUF conversion differs from
the original model, we follow the original model:

* "smollm" (SmolLM / SmolLM2): the original tokenizer.json splits every digit on its own
  (`Digits(individual_digits=True)`) before the GPT-2 byte-level regex, as does llama.cpp's
  "smollm" pre-tokenizer. transformers' GGUF conversion (5.x) uses the plain GPT-2 byte-level
  regex. The vocabulary has no multi-digit tokens, so the two agree on most text, but a run of
  two or more spaces before a digit differs: "x =  12" is [..., "ĠĠ", "1", "2"] in the original
  model and [..., "Ġ", "Ġ", "1", "2"] in transformers' GGUF tokenizer.
* "qwen2": the original tokenizer NFC-normalises text first; transformers' GGUF conversion does not.
* "llama-bpe" (Llama 3): the original BPE has `ignore_merges=True` (whole-word vocabulary hits win),
  as in llama.cpp.

"default" and "gpt-2" use GPT-2's byte-level regex, like transformers (llama.cpp's "default"
splitting is its own and matches no Hugging Face tokenizer).

Sentencepiece ("llama") GGUF vocabularies (Gemma, Llama 2, Mistral, Phi-3, ...) become what the
Hugging Face tokenizer of such a model is: a BPE over the "\u2581"-for-space alphabet with byte
fallback (characters outside the vocabulary become <0xXX> byte tokens), fed by a space -> "\u2581"
normalizer or pre-tokenizer. The file has tokens and scores but no merges; the merges are the
token's splits into two vocabulary tokens, ranked as transformers' GGUF conversion ranks them
(`_sentencepiece_merges`), which reproduces its tokenizer exactly. By `general.architecture`:

* "gemma", "gemma2", "gemma3": Gemma's tokenizer (no prefix space, every space one "\u2581").
  llama.cpp stores the whitespace-run tokens as real spaces ("  "); they are respelled "\u2581\u2581"
  like the original vocabulary, and merges are ranked by position in the file (Gemma's scores do
  not follow its merge order).
* "phi3": as transformers rebuilds Phi-3's: a normalizer prepends "\u2581" to each piece of text
  between added tokens; merges ranked by score.
* anything else: Llama's tokenizer, "\u2581" prepended to the first piece of the text only
  (`Metaspace(prepend_scheme="first")`), merges ranked by score. `tokenizer.ggml.add_space_prefix`
  false turns the prefix off (llama.cpp honours the flag; transformers always prefixes).

Text from the outside world (argv, prompt files, JSON escapes) need not be valid Unicode: Python
carries undecodable argv/file bytes as lone surrogates (surrogateescape) and JSON may hold a lone
`\\udXXX` escape. `clean_text` turns every such byte or surrogate into U+FFFD, the replacement most
tools use (Python's errors="replace", transformers' decode); every encode goes through it, so no
prompt can crash a tokenizer, and the prompt echoed back is the text that was tokenised.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from datetime import datetime
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from dspark_jax.core.errors import UserError

# llama.cpp token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

# The named special tokens transformers exposes to chat templates as variables.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class _PreTokenizerSpec:
    """How the original model splits text before BPE (normalizer, pre-tokenizer, BPE flag)."""

    split_regex: str | None  # None: GPT-2's regex inside ByteLevel
    individual_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False


_GPT2_SPEC = _PreTokenizerSpec(None)
_LLAMA3_SPEC = _PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True)
_GGUF_PRE_TOKENIZERS = {
    "smollm": _PreTokenizerSpec(None, individual_digits=True),
    "gpt-2": _GPT2_SPEC,
    "default": _GPT2_SPEC,
    "llama-bpe": _LLAMA3_SPEC,
    "llama3": _LLAMA3_SPEC,
    "llama-v3": _LLAMA3_SPEC,
    "qwen2": _PreTokenizerSpec(_QWEN2_SPLIT, nfc=True),
}

# Sentencepiece vocabularies: general.architecture -> the Hugging Face tokenizer the model has
# ("llama" for every other architecture). See the module docstring.
_SPM_FLAVOURS = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}


class Tokenizer:
    """A fast tokenizer plus chat template and the ids generation needs (EOS set, BOS, PAD)."""

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None,
                 special_tokens: dict[str, str], eos_token_ids: Iterable[int],
                 bos_token_id: int | None = None, pad_token_id: int | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)  # e.g. {"bos_token": "<s>"}: template variables
        self._eos = tuple(dict.fromkeys(int(i) for i in eos_token_ids))  # ordered, no duplicates
        self._bos = bos_token_id
        self._pad = pad_token_id

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_hf_folder(cls, folder: str) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise UserError(f"missing file {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception on bad JSON
            raise UserError(f"corrupt tokenizer file {path}: {e}") from None
        config = _read_optional_json(os.path.join(folder, "tokenizer_config.json"))
        generation = _read_optional_json(os.path.join(folder, "generation_config.json"))
        special = {name: _token_content(config[name]) for name in _SPECIAL_TOKEN_NAMES
                   if config.get(name) is not None}

        def token_id(name: str) -> int | None:
            return backend.token_to_id(special[name]) if name in special else None

        eos = [token_id("eos_token"), *_as_list(generation.get("eos_token_id"))]
        bos = token_id("bos_token")
        pad = token_id("pad_token")
        return cls(backend, _hf_chat_template(folder, config), special,
                   [i for i in eos if i is not None],
                   bos if bos is not None else generation.get("bos_token_id"),
                   pad if pad is not None else generation.get("pad_token_id"))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "GGUF") -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise UserError(f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.model is missing)")
        if kind not in ("gpt2", "llama"):
            raise UserError(f"{source}: unsupported GGUF tokenizer model {kind!r} "
                            f"(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece BPE)")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise UserError(f"{source}: the GGUF tokenizer has no tokens")
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        ids = {key: meta.get(f"tokenizer.ggml.{key}_token_id")
               for key in ("bos", "eos", "unknown", "padding", "eot", "eom")}
        for key, i in ids.items():
            if i is not None and not 0 <= i < len(tokens):
                raise UserError(f"{source}: tokenizer.ggml.{key}_token_id={i} is outside the vocabulary")
        merges = meta.get("tokenizer.ggml.merges") or []
        # llama.cpp adds a BOS to sentencepiece vocabularies that do not say otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre not in _GGUF_PRE_TOKENIZERS:
                raise UserError(f"{source}: unsupported GGUF pre-tokenizer {pre!r} "
                                f"(supported: {', '.join(sorted(_GGUF_PRE_TOKENIZERS))})")
            backend = _byte_level_bpe(tokens, merges, types, _GGUF_PRE_TOKENIZERS[pre],
                                      ids["bos"] if add_bos else None, source)
        else:  # sentencepiece: tokenizer.ggml.pre does not apply
            add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
            backend = _sentencepiece_bpe(
                tokens, list(meta.get("tokenizer.ggml.scores") or []), merges, types,
                _SPM_FLAVOURS.get(meta.get("general.architecture"), "llama"),
                bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                [ids[k] for k in ("bos", "eos", "unknown", "padding")],
                ids["bos"] if add_bos else None, ids["eos"] if add_eos else None, source)
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        special = {name: tokens[ids[key]] for name, key in names.items() if ids[key] is not None}
        # llama.cpp stops on EOS and on the end-of-turn / end-of-message tokens when they exist.
        eos = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
        return cls(backend, meta.get("tokenizer.chat_template"), special, eos, ids["bos"], ids["padding"])

    # ---------------------------------------------------------------- API

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no BOS/EOS added (chat templates write their own)."""
        return self.backend.encode(clean_text(text), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UserError("this tokenizer has no chat template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def raw_prompt_ids(self, text: str) -> list[int]:
        """Prompt ids of raw text (`decode --raw`, a base model): the text as the model's own
        tokenizer encodes it by default, i.e. transformers' `tokenizer(text)`, with the special
        tokens its configuration adds (a BOS for Gemma 3 and Llama 3; none for SmolLM2 or Qwen).
        A model trained with a BOS degenerates without it."""
        return self.backend.encode(clean_text(text), add_special_tokens=True).ids

    def chat_prompt_ids(self, user_text: str) -> list[int]:
        """Prompt ids for one user turn: the chat template if there is one, else `raw_prompt_ids`."""
        if self.chat_template is None:
            return self.raw_prompt_ids(user_text)
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))


# -------------------------------------------------------------------- chat templates


# Surrogates surrogateescape does not produce (it maps bytes 0x80-0xFF to U+DC80-U+DCFF).
_FOREIGN_SURROGATES = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def clean_text(text: str) -> str:
    """`text` as valid Unicode: undecodable bytes (surrogate-escaped) and lone surrogates -> U+FFFD."""
    if text.isascii():
        return text
    text = _FOREIGN_SURROGATES.sub("\ufffd", text)
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None) -> str:
    """Render like transformers' `apply_chat_template(messages, tokenize=False)`."""
    # transformers drops keys whose value is None (an API's `content=None`) before rendering.
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return _compile_chat_template(template).render(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **(special_tokens or {}))
    except jinja2.TemplateError as e:  # includes the template's own raise_exception(...)
        raise UserError(f"chat template error: {e}") from None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
    rendering it is transparent, but the tag must parse."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '); chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str) -> jinja2.Template:
    # Templates come from model files, i.e. untrusted: sandboxed, immutable environment.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"invalid chat template (line {e.lineno}): {e.message}") from None


# -------------------------------------------------------------------- Hugging Face folders


def _read_optional_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt JSON in {path}: {e}") from None


def _token_content(token) -> str:
    # tokenizer_config.json writes special tokens as strings or as serialised AddedTokens.
    return token["content"] if isinstance(token, dict) else str(token)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _hf_chat_template(folder: str, config: dict) -> str | None:
    """chat_template.jinja (transformers 5 saves it there) wins over tokenizer_config.json's."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


# -------------------------------------------------------------------- GGUF vocabularies


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], spec: _PreTokenizerSpec,
                    bos_to_add: int | None, source: str) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    pairs = _merge_pairs(merges, source)
    try:
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                           ignore_merges=spec.ignore_merges)
    except Exception as e:  # noqa: BLE001 - merges naming tokens outside the vocabulary
        raise UserError(f"{source}: inconsistent GGUF vocabulary/merges: {e}") from None
    backend = tokenizers.Tokenizer(model)
    if spec.nfc:
        backend.normalizer = normalizers.NFC()
    steps = []
    if spec.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split_regex is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split_regex), behavior="isolated", invert=False))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split_regex is None))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=False)]
    if bos_to_add is not None:
        bos = tokens[bos_to_add]
        post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                  special_tokens=[(bos, bos_to_add)]))
    backend.post_processor = processors.Sequence(post)
    # Control tokens (<|im_start|>, ...) and user-defined ones (<think>, ...) match whole in raw
    # text; only control tokens are "special" (dropped by decode(skip_special_tokens=True)).
    added = [AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED) and vocab.get(tokens[i]) == i]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])
    return backend


def _sentencepiece_bpe(tokens: list[str], scores: list[float], merges: list[str], types: list[int],
                       flavour: str, space_prefix: bool, named_ids: Sequence[int | None],
                       bos_to_add: int | None, eos_to_add: int | None, source: str) -> tokenizers.Tokenizer:
    """The Hugging Face tokenizer of a sentencepiece-BPE model; `flavour`: see the module docstring."""
    spelled = tokens
    if flavour == "gemma":
        # Whitespace-run tokens are real spaces in the file, "\u2581\u2581"... in the original vocabulary.
        spelled = ["\u2581" * len(t) if t and t.strip(" ") == "" else t for t in tokens]
    vocab = {token: i for i, token in enumerate(spelled)}  # a repeated token: the last id, as llama.cpp
    if merges:
        pairs = _merge_pairs(merges, source)
    elif flavour == "gemma":
        pairs = _sentencepiece_merges(vocab, None, len(tokens))
    else:
        if len(scores) != len(tokens):
            raise UserError(f"{source}: the GGUF sentencepiece vocabulary has {len(tokens)} tokens and "
                            f"{len(scores)} scores (and no merges)")
        pairs = _sentencepiece_merges(vocab, dict(zip(spelled, scores)), len(tokens))
    # transformers sets no unknown token for Llama; without one a character that has no byte token
    # either would vanish (all real vocabularies have the 256 byte tokens, so it never matters).
    unk_id = named_ids[2]
    unk = tokens[unk_id] if unk_id is not None else "<unk>" if "<unk>" in vocab else None
    try:
        model = models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:  # noqa: BLE001 - merges naming tokens outside the vocabulary
        raise UserError(f"{source}: inconsistent GGUF vocabulary/merges: {e}") from None
    backend = tokenizers.Tokenizer(model)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if flavour == "gemma":
        # Every space is one "\u2581" and nothing is prepended. (The split is a no-op after the
        # normalizer; transformers' GemmaTokenizer has it, so the pipeline is the same one.)
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    elif flavour == "phi3":
        replace = normalizers.Replace(" ", "\u2581")
        backend.normalizer = (normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
                              if space_prefix else replace)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if space_prefix else "never", split=False)
    if flavour != "gemma" and space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the prepended space
    backend.decoder = decoders.Sequence(steps)
    # What `tokenizer(text)` adds, in transformers' form (type ids 0, then 1 for a pair).
    specials = [(tokens[i], i) for i in (bos_to_add, eos_to_add) if i is not None]

    def sequence(name: str, type_id: int) -> str:
        around = [f"{tokens[i]}:{type_id}" if i is not None else None for i in (bos_to_add, eos_to_add)]
        return " ".join(p for p in (around[0], f"${name}:{type_id}", around[1]) if p is not None)

    backend.post_processor = processors.TemplateProcessing(
        single=sequence("A", 0), pair=f"{sequence('A', 0)} {sequence('B', 1)}", special_tokens=specials)
    # As for byte-level vocabularies: control tokens (<start_of_turn>, ...) are special added
    # tokens, user-defined ones ("\n", "[multimodal]", ...) plain added tokens, both matched whole
    # in the raw text. (Gemma's whitespace runs, "  " in the file, are not: they are respelled.)
    # The BOS/EOS/UNK/PAD tokens are special whatever their type (Llama's <unk> is "unknown").
    named = {i for i in named_ids if i is not None}
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types)
                                if (t == _CONTROL or i in named) and vocab.get(tokens[i]) == i])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED and vocab.get(tokens[i]) == i])
    return backend


def _merge_pairs(merges: list[str], source: str) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        # Split at the first space after the first character, as llama.cpp does.
        cut = merge.find(" ", 1)
        if cut < 0:
            raise UserError(f"{source}: corrupt GGUF merge {merge!r}")
        pairs.append((merge[:cut], merge[cut + 1:]))
    return pairs


def _sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float] | None,
                          n_tokens: int) -> list[tuple[str, str]]:
    """The merges a sentencepiece-BPE vocabulary implies: every split of a token into two
    vocabulary tokens, ranked by the token's score (None: by its position, first best), then
    longer left part first, then longer right part first (between tokens of equal score), then
    vocabulary order -- the order of transformers' `generate_merges` with `vocab_scores`, which
    its GGUF conversion uses.

    About 515,000 merges for Gemma's 262,144 tokens in 1-2 s (2 shared cores): every token is
    looked at once and, ranked by position, the splits come out in order with no sort."""
    if scores is None:
        # vocab iterates in order of first appearance; a repeated token ranks at its last id.
        order: Iterable[str] = vocab if len(vocab) == n_tokens else sorted(vocab, key=vocab.__getitem__)
    else:
        order = vocab
    pairs: list[tuple[str, str]] = []
    keys: list[tuple[float, int, int]] = []
    for token in order:
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    pairs.append((left, right))
                    if scores is not None:
                        keys.append((scores[token], cut, len(right)))
    if scores is None:
        return pairs
    # Best score first; `reverse` keeps equal keys in their original (vocabulary) order.
    ranked = sorted(range(len(pairs)), key=keys.__getitem__, reverse=True)
    return [pairs[i] for i in ranked]
