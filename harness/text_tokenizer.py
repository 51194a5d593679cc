"""An HF model folder's tokenizer without transformers: the `tokenizers` library and jinja2 only.

Why: the autograder runs the student's code in a worker process whose environment has no
transformers (transformers holds the oracle the tests compare against: a worker that could import
it could compute the expected answers). L11's server runs in that worker and needs a tokenizer, so
it uses this one. It offers only what l11_serve calls (encode, decode, apply_chat_template and
chat_template; the special-token names the template sees), and each answer equals what
transformers' AutoTokenizer answers for the same folder (tests/test_l11_tokenizer.py checks it).

What transformers (v5) does when it loads a folder with a tokenizer.json, and what is copied here:
- The tokens come from tokenizer.json as the `tokenizers` library reads it: its normalizer,
  pre-tokenizer, model, post-processor (the BOS/EOS that add_special_tokens=True adds) and decoder.
  transformers drops tokenizer_config.json's add_bos_token/add_eos_token when tokenizer.json is
  there, so the file's post-processor decides.
- The named special tokens (bos_token, eos_token, ...) come from tokenizer_config.json (and, in an
  old folder without `added_tokens_decoder`, special_tokens_map.json). Any of them, and any extra
  special token, that tokenizer.json does not already have as an added token is added as a special
  one; so are the config's `added_tokens_decoder` entries (their flags win over the file's).
- decode: the library's decode, then clean_up_tokenization when the config asks for it, which
  transformers skips for a BPE model (it would eat real spaces before punctuation) unless the
  config insists with clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output.
- The chat template: chat_template.jinja (and additional_chat_templates/*.jinja) before the
  config's `chat_template`; rendered by jinja2 under transformers' rules (see `_environment`) with
  messages, tools, documents, add_generation_prompt, the named special tokens and the caller's
  keyword arguments as variables; then encoded without special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the named special tokens.
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(model_dir) -> "TextTokenizer | None":
    """The folder's tokenizer; None for a folder without one (ids only then), as harness.smoke's
    load_tokenizer; ModelLoadError (an InputError: one line, exit 2) for one that cannot be read."""
    from l1_contiguous.errors import ModelLoadError

    model_dir = Path(model_dir)
    if not any((model_dir / name).exists() or (model_dir / name).is_symlink() for name in TOKENIZER_FILES):
        return None
    try:
        return TextTokenizer.from_folder(model_dir)
    except Exception as exc:  # a broken tokenizer.json raises whatever its parser raises
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"the tokenizer in {model_dir} cannot be loaded ({reason}); fix or remove "
                             f"tokenizer.json, or use --prompt-ids") from None


class TextTokenizer:
    """encode, decode and apply_chat_template of a model folder, equal to AutoTokenizer's."""

    def __init__(self, backend: Tokenizer, config: dict, legacy_map: dict | None = None,
                 chat_template: str | dict | None = None):
        self.backend = backend
        config = _v5_names(dict(config))
        if backend.padding:  # transformers takes the pad token from the file's padding when the config has none
            config.setdefault("pad_token", backend.padding["pad_token"])
        # transformers turns the file's truncation and padding off on every call that asks for neither.
        backend.no_truncation()
        backend.no_padding()
        added = {}  # content -> AddedToken: the folder's own description of its added tokens
        config_added = []  # tokenizer_config.json's added_tokens_decoder, in id order: added again
        if "added_tokens_decoder" in config:
            for _, entry in sorted(config["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
                token = AddedToken(**entry)
                config_added.append(token)
                added[token.content] = token
        else:
            # An older folder: special_tokens_map.json's values overwrite the config's, and the added
            # tokens are tokenizer.json's (transformers reads the map only in this case).
            for key, value in (legacy_map or {}).items():
                if isinstance(value, dict) and key != "extra_special_tokens":
                    value = AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
                elif key == "extra_special_tokens" and isinstance(value, list):
                    merged = list(config.get("extra_special_tokens") or [])
                    merged += [t for t in (AddedToken(**t, special=True) if isinstance(t, dict) else t
                                           for t in value) if t not in merged]
                    value = merged
                config[key] = value
            config = _v5_names(config)
            added = {t.content: t for t in backend.get_added_tokens_decoder().values()}
        # Named tokens: the seven standard ones, then a model's own *_token names (image_token, ...).
        named = {}
        for key, value in config.items():
            value = AddedToken(**{k: v for k, v in value.items() if k != "__type"}) if _is_token_dict(value) else value
            if (key in NAMED_TOKENS or key.endswith("_token")) and isinstance(value, (str, AddedToken)):
                named[key] = added.get(str(value), value) if key in NAMED_TOKENS else value
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):  # the named form of extra tokens: more model-specific names
            named.update(extra)
            extra = []
        self._named = {k: named[k] for k in (*NAMED_TOKENS, *named) if k in named}
        self._extra = list(extra or [])
        self._add_missing_tokens(config_added)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._clean_bpe_anyway = bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        if chat_template is None:
            chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # the config's list form: [{"name": ..., "template": ...}]
            chat_template = {t["name"]: t["template"] for t in chat_template}
        self.chat_template = chat_template  # a str, a dict of named templates, or None (protocol's fallback)

    @classmethod
    def from_folder(cls, folder) -> "TextTokenizer":
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json", {})
        legacy_map = _read_json(folder / "special_tokens_map.json", {})
        if not isinstance(config, dict) or not isinstance(legacy_map, dict):
            raise ValueError("tokenizer_config.json and special_tokens_map.json must hold JSON objects")
        if not (folder / "tokenizer.json").is_file():
            # transformers could build one from vocab.json/merges.txt or a SentencePiece model; this
            # tokenizer reads the `tokenizers` library's own file only (every Qwen3 folder has it).
            raise ValueError("no tokenizer.json; this server reads a tokenizer from tokenizer.json only")
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        return cls(backend, config, legacy_map, _template_files(folder))

    def _add_missing_tokens(self, config_added: list[AddedToken]) -> None:
        """transformers' TokenizersBackend.__init__: the config's added tokens again, then each named
        or extra special token the tokenizer does not have as an added token yet; a named one is
        always special."""
        present = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        present |= {t.content for t in config_added}
        to_add = list(config_added)
        for value in [*self._named.values(), *self._extra]:
            if str(value) not in present and value not in to_add:
                to_add.append(value)
        named = {str(v) for v in self._named.values()}
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and token.content in named:
                token.special = True
            tokens.append(token)
        if tokens:
            self.backend.add_tokens(tokens)

    # --- the special tokens (what the chat template sees as variables) ---

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {key: str(value) for key, value in self._named.items()}

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def all_special_ids(self) -> list[int]:
        """The ids of the named and the extra special tokens, each once, in that order."""
        tokens = list(dict.fromkeys([*self.special_tokens_map.values(), *map(str, self._extra)]))
        return [self.backend.token_to_id(t) for t in tokens]

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; add_special_tokens: what tokenizer.json's post-processor adds (a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean = clean_up_tokenization_spaces
        if clean is None:
            clean = self.clean_up_tokenization_spaces
        if clean and (type(self.backend.model).__name__ != "BPE" or self._clean_bpe_anyway):
            text = clean_up_tokenization(text)
        return text

    # --- chat ---

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs):
        """One conversation through the chat template. tokenize: its ids, as {"input_ids",
        "attention_mask"} (transformers' BatchEncoding holds the same) or, return_dict=False, the
        list; otherwise the rendered text. kwargs are template variables (Qwen3's enable_thinking);
        they win over the special-token names. The parameters named here are the ones l11_serve
        refuses as chat_template_kwargs (see protocol._template_kwargs)."""
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self._template(chat_template, tools)
        # As transformers: keys whose value is None are dropped (OpenAI's content=None renders as "None" otherwise).
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        variables = {**self.special_tokens_map, **kwargs}
        text = _compile(template).render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)  # the template writes the special tokens itself
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _template(self, name: str | None, tools) -> str:
        """transformers' get_chat_template: with several named templates, `name`'s, or "tool_use"
        when tools are given, else "default"; a `name` that is none of them is a template itself."""
        if isinstance(self.chat_template, dict):
            if name in self.chat_template:
                return self.chat_template[name]
            if name is None:
                key = "tool_use" if tools is not None and "tool_use" in self.chat_template else "default"
                if key not in self.chat_template:
                    raise ValueError(f"this tokenizer has several chat templates ({', '.join(self.chat_template)}) "
                                     f"and none is the default; name one")
                return self.chat_template[key]
            return name
        if name is not None:
            return name
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is not set)")
        return self.chat_template


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: the spaces a WordPiece decode puts before punctuation."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' AssistantTracker marks the
    assistant's text with it, for training masks): here it renders its body, nothing more, so that
    a template that uses it compiles and renders the same text."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON as it is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache
def _environment() -> ImmutableSandboxedEnvironment:
    """transformers' rules for chat templates (utils/chat_template_utils.py): a sandbox, since a
    template is code from the model's folder; trim_blocks and lstrip_blocks, so that a `{% ... %}`
    line leaves no newline or indent of its own; {% break %}/{% continue %}; tojson without HTML
    escaping; raise_exception and strftime_now. (transformers also swaps Jinja's `dict` and
    `namespace` for copies that refuse attribute tricks; a template renders the same with either.)"""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _template_files(folder: Path) -> str | dict | None:
    """The template files, which win over the config's `chat_template`: chat_template.jinja is the
    default; additional_chat_templates/NAME.jinja are named ones (then all of them form a dict)."""
    templates = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


def _v5_names(config: dict) -> dict:
    """transformers v5 calls additional_special_tokens extra_special_tokens."""
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    return config


def _is_token_dict(value) -> bool:
    """A serialized AddedToken in a config: {"__type": "AddedToken", "content": ..., ...}."""
    return isinstance(value, dict) and value.get("__type") == "AddedToken"


def _read_json(path: Path, default):
    if not (path.exists() or path.is_symlink()):
        return default
    return json.loads(path.read_text(encoding="utf-8"))
