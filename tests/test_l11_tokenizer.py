"""harness/text_tokenizer.py, the tokenizer L11's server uses (the grader's worker has no
transformers): every answer equals transformers' AutoTokenizer's for the same folder, and the
server starts and serves completions and chat with transformers unimportable. Provided code, so no
points. Folders: the embedded model; a Qwen3-style one made here (Qwen2Tokenizer, NFC and Qwen's
split regex, <|im_start|>/<|im_end|>/<think> added, a chat template in the manner of Qwen3's); an
old-style one whose special tokens come from special_tokens_map.json, one of them new; a WordPiece
one whose config asks for clean_up_tokenization_spaces."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer

from harness.text_tokenizer import TextTokenizer, load_tokenizer
from l1_contiguous import InputError
from l1_contiguous.errors import ModelLoadError

pytestmark = pytest.mark.l11

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_ADDED = [("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False), ("</think>", False),
              ("<tool_call>", False)]

# Written here in the manner of Qwen3's template (not a copy): the system turn or a tools block
# first, a reversed loop with a namespace to find the last user query, reasoning split out of
# earlier assistant turns, raise_exception, break, tojson, string methods, enable_thinking.
QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=-1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and message.content is string %}
        {%- set ns.last_query_index = (messages | length - 1) - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_query_index < 0 %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# HF's other rules: trim_blocks/lstrip_blocks (tags alone on indented lines, no "-"), continue,
# the special tokens as variables, {% generation %}, tojson's arguments, strftime_now.
RULES_TEMPLATE = """\
{% for m in messages %}
    {% if m.role == 'system' %}
        {% continue %}
    {% endif %}
  [{{ m.role }}] {{ m.content }}{{ eos_token }}{% if m.name is defined %} ({{ m.name }}){% endif %}
    {% if m.role == 'assistant' %}{% generation %}({{ m.content | length }}){% endgeneration %}{% endif %}
{% endfor %}
{% if extra is defined %}{{ extra | tojson(indent=1, sort_keys=true) }}{% endif %}
{{ strftime_now('%Y') }}{{ pad_token }}
{% if add_generation_prompt %}
  [assistant]
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Who begat Enos?"}],
    [{"role": "system", "content": "Answer as the scribe."}, {"role": "user", "content": "Blessed are the"}],
    [{"role": "system", "content": "Be brief, “gentle” & <true>."},
     {"role": "user", "content": "In the beginning"},
     {"role": "assistant", "content": "<think>\nfirst words\n</think>\n\nGod created the heaven."},
     {"role": "user", "content": "And then? <|im_end|> 日本 😀 e\u0301"},
     {"role": "assistant", "content": "And the earth was without form.", "reasoning_content": None},
     {"role": "user", "content": "Go on.", "name": None}],
    [{"role": "user", "content": "Thus saith the LORD"},
     {"role": "assistant", "content": "<think>\nhe spoke\n</think>\n\nHear ye."}],
]


def _added(raw: dict, tokens: list[tuple[str, bool]]) -> None:
    """New added tokens with the next ids after the vocabulary's and the added tokens' so far."""
    first = max([len(raw["model"]["vocab"]) - 1] + [t["id"] for t in raw["added_tokens"]]) + 1
    for i, (content, special) in enumerate(tokens):
        raw["added_tokens"].append({"id": first + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": special})


def _folder(root: Path, name: str, source: Path) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text((source / "config.json").read_text())  # AutoTokenizer reads model_type
    return folder


@pytest.fixture(scope="module")
def folders(embedded_model_dir, tmp_path_factory) -> dict[str, Path]:
    root, src = tmp_path_factory.mktemp("tokenizers"), Path(embedded_model_dir)
    raw = json.loads((src / "tokenizer.json").read_text())

    # Qwen3's layout: tokenizer.json agrees with what transformers' Qwen2Tokenizer builds from its
    # vocab and merges (it rebuilds the pipeline), the config lists the added tokens and names the specials.
    qwen = _folder(root, "qwen3-style", src)
    q = json.loads(json.dumps(raw))
    q["normalizer"] = {"type": "NFC"}
    q["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    q["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    q["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    _added(q, QWEN_ADDED)
    (qwen / "tokenizer.json").write_text(json.dumps(q))
    _added(q, [("</tool_call>", False)])  # only the config has it: added from there, with the next id
    (qwen / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in q["added_tokens"]},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False, "errors": "replace",
        "model_max_length": 40960, "split_special_tokens": False, "chat_template": QWEN_STYLE_TEMPLATE}))

    # An older folder: no added_tokens_decoder, so special_tokens_map.json names the specials; its
    # bos_token and extra token are in no vocabulary (both are added, with new ids).
    legacy = _folder(root, "legacy", src)
    (legacy / "tokenizer.json").write_text(json.dumps(raw))
    (legacy / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "eos_token": "<|endoftext|>", "additional_special_tokens": ["<extra_0>"]}))
    # The template files win over the config's template; the extra folder makes them a dict.
    (legacy / "chat_template.jinja").write_text(RULES_TEMPLATE)
    (legacy / "additional_chat_templates").mkdir()
    (legacy / "additional_chat_templates" / "terse.jinja").write_text("{{ messages[-1].content }}")
    (legacy / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
        "chat_template": "never used"}))

    # WordPiece, where clean_up_tokenization_spaces does apply (transformers skips it for BPE), a
    # post-processor that adds [CLS] and [SEP], and truncation and padding in the file (transformers
    # turns both off for a call that asks for neither; the padding's token is the pad_token).
    wordpiece = _folder(root, "wordpiece", src)
    words = ["[UNK]", "[CLS]", "[SEP]", "hello", "world", ",", ".", "'", "s", "t", "don", "n", "?", "!", "the",
             "king", "##s", "m", "re", "ve", "lord", "##d", "and", "said"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece()
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]"])
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tok.enable_truncation(max_length=6)
    tok.enable_padding(length=40, pad_id=len(words), pad_token="[PAD]")
    tok.add_special_tokens(["[PAD]"])
    tok.save(str(wordpiece / "tokenizer.json"))
    # The config's added tokens call [SEP] not special (it is named, so it is made special again);
    # [MASK] and a model's own audio_token are in no vocabulary (added, with new ids).
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    (wordpiece / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True,
        "added_tokens_decoder": {str(i): {"content": t, **flags, "special": t != "[SEP]"}
                                 for i, t in enumerate(words[:3])},
        "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]",
        "audio_token": "[AUDIO]"}))
    return {"embedded": src, "qwen3-style": qwen, "legacy": legacy, "wordpiece": wordpiece}


@pytest.fixture(scope="module")
def pairs(folders) -> dict[str, tuple]:
    """(AutoTokenizer, TextTokenizer) per folder."""
    return {name: (AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder))
            for name, folder in folders.items()}


FOLDERS = ["embedded", "qwen3-style", "legacy", "wordpiece"]
PIECES = (list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789.,;:!?'\"-()\n\t\r")
          + ["  ", "\n\n", " \n", "'s", "'LL", "don't", "—", "“", "”", "é", "e\u0301", "ﬁ", "Å", "日本語", "😀",
             "👨‍👩‍👧", "שלום", "\u200b", "hello", "world", "the LORD", "king", "And God said"]
          # every folder's added and special tokens, and a piece of one
          + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|im_", "<tool_call>",
             "</tool_call>", "<s>", "<extra_0>", "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[AUDIO]"])


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["", " ", "\n"] + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 24))) for _ in range(count)]


@pytest.mark.parametrize("name", FOLDERS)
def test_encode_equals_autotokenizer(pairs, name):
    hf, ours = pairs[name]
    for text in random_texts(1, 300):
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), \
                (name, text, special)


@pytest.mark.parametrize("name", FOLDERS)
def test_decode_equals_autotokenizer_with_and_without_special_tokens(pairs, name):
    hf, ours = pairs[name]
    rng = random.Random(2)
    size = hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    added = list(hf.backend_tokenizer.get_added_tokens_decoder())
    assert set(hf.all_special_ids) <= set(added)
    # Random ids, a third of them added (special or not) ids; and each id alone (a stream's token).
    sequences = [[rng.choice(added) if rng.random() < 0.3 else rng.randrange(size) for _ in range(rng.randint(0, 16))]
                 for _ in range(300)] + [[i] for i in range(size)]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), \
                (name, ids, skip)
    ids = hf.encode("hello, world. the king's don't? And God said")
    assert ours.decode(ids, clean_up_tokenization_spaces=False) == hf.decode(ids, clean_up_tokenization_spaces=False)
    assert ours.decode(ids[0]) == hf.decode(ids[0])  # one id, not in a list


def test_clean_up_tokenization_spaces_is_applied_as_transformers_does(pairs):
    """The WordPiece folder asks for it and gets it; the legacy (BPE) one asks and does not (transformers
    skips it for BPE: it would eat the spaces before punctuation that the text really has)."""
    hf, ours = pairs["wordpiece"]
    ids = hf.encode("the king's lord , and said")
    assert ours.decode(ids) == hf.decode(ids) != hf.decode(ids, clean_up_tokenization_spaces=False)
    hf, ours = pairs["legacy"]
    ids = hf.encode("Amen . Selah ! Who ' s there ?")
    assert ours.decode(ids) == hf.decode(ids) == hf.decode(ids, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("name", FOLDERS)
def test_special_tokens_and_template_source_equal_autotokenizer(pairs, name):
    hf, ours = pairs[name]
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_ids == hf.all_special_ids
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == (hf.bos_token, hf.eos_token, hf.eos_token_id)
    assert ours.chat_template == hf.chat_template
    assert ours.backend.get_added_tokens_decoder() == hf.backend_tokenizer.get_added_tokens_decoder()
    if name == "legacy":  # the template files' dict, not the config's string
        assert set(ours.chat_template) == {"default", "terse"}


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}-turns")
@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("variables", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["default", "no-thinking", "thinking"])
def test_qwen_style_chat_template_equals_autotokenizer(pairs, messages, generation_prompt, variables):
    hf, ours = pairs["qwen3-style"]
    kwargs = {"add_generation_prompt": generation_prompt, **variables}
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == dict(hf.apply_chat_template(messages, **kwargs))
    ids = ours.apply_chat_template(messages, return_dict=False, **kwargs)
    assert ids == hf.apply_chat_template(messages, return_dict=False, **kwargs)
    assert text.count("<|im_start|>") == ids.count(hf.convert_tokens_to_ids("<|im_start|>"))  # one id each


def test_tools_go_through_tojson_as_transformers_renders_them(pairs):
    hf, ours = pairs["qwen3-style"]
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "look_up", "description": "A verse <b>&</b> 'its' “book”",
                                               "parameters": parameters}}]
    messages = CONVERSATIONS[1]
    ours_text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours_text == hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<b>&</b>" in ours_text and "“book”" in ours_text  # not HTML-escaped, not ASCII-escaped


def test_a_template_that_raises_raises_the_same(pairs):
    hf, ours = pairs["qwen3-style"]
    for messages, words in (([{"role": "system", "content": "Alone."}], "No user query"),
                            ([{"role": "user", "content": "x"}, {"role": "developer", "content": "y"}], "developer")):
        with pytest.raises(jinja2.TemplateError, match=words) as want:
            hf.apply_chat_template(messages, add_generation_prompt=True)
        with pytest.raises(jinja2.TemplateError, match=words) as got:
            ours.apply_chat_template(messages, add_generation_prompt=True)
        assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}-turns")
def test_hf_jinja_rules_render_the_same(pairs, messages):
    """trim_blocks, lstrip_blocks, continue, {% generation %}, tojson(indent, sort_keys), strftime_now,
    the special tokens as variables, and a keyword argument that overrides one of them."""
    hf, ours = pairs["legacy"]
    for kwargs in ({}, {"extra": {"b": [1, "é<"], "a": None}}, {"eos_token": "<END>"}):
        for prompt in (True, False):
            want = hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False, **kwargs) == want
            assert ours.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False, **kwargs) == \
                hf.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False, **kwargs)
    named = ours.apply_chat_template(messages, chat_template="terse", tokenize=False)
    assert named == hf.apply_chat_template(messages, chat_template="terse", tokenize=False) == messages[-1]["content"]


def test_the_servers_chat_prompt_ids_equal_with_either_tokenizer(pairs):
    """l11_serve.protocol builds the same prompt from AutoTokenizer and from this one, template
    variables included; the embedded folder (no template) gets the minimal `role: text` lines."""
    from l11_serve.protocol import chat_prompt_ids, parse_chat

    for name in ("qwen3-style", "embedded"):
        hf, ours = pairs[name]
        for messages in CONVERSATIONS:
            for variables in ({}, {"enable_thinking": False}):
                assert chat_prompt_ids(messages, ours, variables) == chat_prompt_ids(messages, hf, variables)
        body = {"messages": CONVERSATIONS[1], "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 2}
        assert parse_chat(body, ours, "m").prompts == parse_chat(body, hf, "m").prompts
    assert pairs["embedded"][1].chat_template is None


def test_the_protocol_refuses_what_is_not_a_template_variable_and_reports_a_refusal(pairs):
    from l11_serve.protocol import parse_chat

    _, ours = pairs["qwen3-style"]
    for kwargs in ({"messages": []}, {"tokenize": False}, {"add_generation_prompt": False}):
        with pytest.raises(InputError, match="chat_template_kwargs"):
            parse_chat({"messages": CONVERSATIONS[0], "chat_template_kwargs": kwargs}, ours, "m")
    with pytest.raises(InputError, match="refused these messages: No user query found"):
        parse_chat({"messages": [{"role": "system", "content": "Alone."}]}, ours, "m")


def test_load_tokenizer_as_the_smoke_scripts_do(tmp_path, embedded_model_dir):
    """None without tokenizer files (ids only); a one-line ModelLoadError for a broken one."""
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="cannot be loaded"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(embedded_model_dir), TextTokenizer)


def test_the_server_runs_without_transformers(monkeypatch, embedded_model_dir, tmp_path):
    """The grader's worker has no transformers: with it unimportable, the server builds on the
    embedded model and answers a completion and a chat (the minimal template, then a folder's
    own template read from chat_template.jinja); a template's refusal is a 400."""
    from starlette.testclient import TestClient

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError now
    with pytest.raises(ImportError):
        __import__("transformers")
    from l11_serve import build_server

    folder = tmp_path / "with-template"
    folder.mkdir()
    for src in Path(embedded_model_dir).iterdir():
        (folder / src.name).symlink_to(src)
    (folder / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    for model_dir, chat in ((embedded_model_dir, "assistant:"), (folder, "<|im_start|>assistant\n")):
        app, loop, tokenizer = build_server(model_dir, num_blocks=32, block_size=16)
        assert isinstance(tokenizer, TextTokenizer)
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True) != ""
            messages = [{"role": "user", "content": "Blessed are the"}]
            r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
            assert tokenizer.decode(ids).endswith(chat)
            if model_dir == folder:
                r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]})
                assert r.status_code == 400 and "No user query found" in r.json()["error"]["message"], r.text
