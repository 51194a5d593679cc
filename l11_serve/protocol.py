"""The OpenAI completions request, checked field by field (lesson L11, §2.3 "The protocol").

Anything wrong is an `InputError` with one line that names the field, what it got and what it
wants; the app answers it with a 400 and an OpenAI-style error body. Nothing reaches the engine
thread unchecked except what only the engine can judge (the prompt's length against the pool).
"""

from __future__ import annotations

import inspect
import math
import secrets
from dataclasses import dataclass

import jinja2

from l1_contiguous import InputError
from l1_contiguous.errors import short_repr

from .engine import MAX_LOGPROBS, ServeItem

# Fields this server accepts only at their neutral value (the value that changes nothing), or at
# any value where the entry is None (they change nothing here). OpenAI's first:
NEUTRAL = {"best_of": (None, 1), "user": None, "suffix": (None,), "logit_bias": (None, {})}
# then vLLM's extensions, at the defaults its clients send. A typo (`max_token`) stays an error:
# vLLM logs unknown fields and ignores them, which would sample with the default silently.
VLLM_NEUTRAL = {
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
    "bad_words": (None, []), "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,), "structural_tag": (None,),
    "response_format": (None, {"type": "text"}), "priority": (None, 0), "cache_salt": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "mm_processor_kwargs": (None,),
    "request_id": None,  # vLLM's own id for its logs; ours is x-request-id
}


MAX_PROMPTS = 64  # prompts in one request's batch: each takes a waiting slot and a group of samples


@dataclass
class CompletionParams:
    prompts: list[list[int]]  # one, or a batch: each runs as its own group of n samples
    max_tokens: int | None  # None: up to the end of the context (chat's default, vLLM's)
    temperature: float
    top_p: float
    n: int
    seed: int | None  # None: every prompt draws a seed of its own
    stop: list[str]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0  # 0: off; k: only the k most likely tokens
    min_p: float = 0.0  # 0: off; p: only tokens at least p times as likely as the most likely
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def work_items(self, max_model_len: int) -> list[ServeItem]:
        """One engine item per prompt, each with the request's sampling settings and its own seed.
        max_model_len: the most positions a request may reach, what max_tokens None runs up to."""
        return [ServeItem(prompt, self.new_tokens(prompt, max_model_len), n=self.n, temperature=self.temperature,
                          seed=self.prompt_seed(k), top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                          stop_token_ids=tuple(self.stop_token_ids),
                          ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                          presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                          repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
                          prompt_logprobs=self.logprobs if self.echo else None)
                for k, prompt in enumerate(self.prompts)]

    def new_tokens(self, prompt: list[int], max_model_len: int) -> int:
        """The engine's max_new_tokens for `prompt`: max_tokens, or what the context leaves (at
        least 1: a prompt that fills the context is then refused by the engine, which says why)."""
        if self.max_tokens is None:
            return max(max_model_len - len(prompt), 1)
        return max(self.max_tokens, 1)  # echo with max_tokens 0 scores the prompt: one token, never sent

    def prompt_seed(self, k: int) -> int:
        """Prompt k's seed; its sample i draws with this + i (L8's rule). With a seed: seed + k*n,
        so choice c of the response (prompt c // n, sample c % n) draws with seed + c. Without
        one: a fresh random seed per prompt, so that equal prompts in a batch draw independently."""
        return self.seed + k * self.n if self.seed is not None else secrets.randbelow(2**63)


SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
                 "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "top_k", "min_p", "stop_token_ids"}


def _check_fields(body: dict, own: set[str], neutral_values: dict) -> None:
    """Unknown fields are an error (a typo would be ignored silently); fields this server does not
    implement are accepted at their neutral value only."""
    known = SHARED_FIELDS | own | set(neutral_values)
    unknown = sorted(set(body) - known)
    if unknown:
        named = sorted(SHARED_FIELDS | own)  # the neutral-only ones are too many to list
        raise InputError(f"unknown field {unknown[0]!r}; this server reads {', '.join(named)} (and "
                         f"OpenAI's and vLLM's other fields at their defaults)")
    for name, neutral in neutral_values.items():
        if neutral is not None and body.get(name, neutral[0]) not in neutral:
            raise InputError(f"{name}={short_repr(body[name])} is not supported by this server; leave it out")


def parse_completion(body, tokenizer, model_name: str) -> CompletionParams:
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object like {\"prompt\": \"...\", \"max_tokens\": 16}")
    _check_fields(body, {"prompt", "logprobs", "echo", "add_special_tokens"}, {**NEUTRAL, **VLLM_NEUTRAL})
    if body.get("model", model_name) not in (model_name, None):
        raise InputError(f"model {body['model']!r} is not served here; GET /v1/models lists {model_name!r}")
    if body.get("stop") and tokenizer is None:
        raise InputError("stop strings need a tokenizer and this model folder has none; use stop_token_ids")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise InputError("stream_options must be an object with at most include_usage and continuous_usage_stats "
                         "(booleans)")
    echo = _bool(body, "echo")
    # OpenAI's and vLLM's default for completions is 16; null (vLLM) runs to the context's end.
    # 0 only with echo: score the prompt, generate nothing.
    max_tokens = None if "max_tokens" in body and body["max_tokens"] is None else \
        _int(body, "max_tokens", 16, low=0 if echo else 1)
    prompts = _prompts(body.get("prompt"), tokenizer, _bool(body, "add_special_tokens"))
    n = _int(body, "n", 1, low=1, high=16)
    return CompletionParams(
        prompts=prompts,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, open_low=True),
        n=n,
        seed=_seed(body, len(prompts) * n),
        stop=_stop(body.get("stop")),
        stop_token_ids=_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        stream=_bool(body, "stream"),
        include_usage=_bool(options, "include_usage"),
        continuous_usage=_bool(options, "continuous_usage_stats"),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0, low=0, high=max_tokens),
        presence_penalty=_number(body, "presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, low=0.0, high=2.0, open_low=True),
        top_k=max(_int(body, "top_k", 0, low=-1), 0),  # vLLM: -1 and 0 both mean off
        min_p=_number(body, "min_p", 0.0, low=0.0, high=1.0),
        logprobs=_int(body, "logprobs", None, low=0, high=MAX_LOGPROBS) if body.get("logprobs") is not None else None,
        echo=echo)


CHAT_NEUTRAL = {**NEUTRAL, **VLLM_NEUTRAL, "echo": (False, None), "tools": (None, []),
                "tool_choice": (None, "none"), "parallel_tool_calls": None,
                "store": (None, False), "metadata": None, "service_tier": None,
                # vLLM's chat extensions
                "add_special_tokens": (None, False), "add_generation_prompt": (None, True),
                "continue_final_message": (None, False), "chat_template": (None,), "documents": (None,),
                "reasoning_effort": (None,), "include_reasoning": None}  # no reasoning parser here
ROLES = ("system", "user", "assistant", "developer")
# For a model folder whose tokenizer has no chat template (the embedded KJV model was never taught
# to chat): each message on its own line as "role: text", then "assistant:" for the model to go on.
MINIMAL_TEMPLATE = "{role}: {content}\n"


def parse_chat(body, tokenizer, model_name: str) -> CompletionParams:
    """OpenAI's chat completions: `messages` through the tokenizer's chat template (a real Qwen3
    folder's own; MINIMAL_TEMPLATE where it has none), then the same request as a completion."""
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object like {\"messages\": [{\"role\": \"user\", "
                         "\"content\": \"...\"}]}")
    if tokenizer is None:
        raise InputError("chat needs a tokenizer and this model folder has none; use /v1/completions with ids")
    own = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs"}
    _check_fields(body, own, CHAT_NEUTRAL)
    prompt_ids = chat_prompt_ids(messages(body.get("messages")), tokenizer,
                                 _template_kwargs(body.get("chat_template_kwargs"), tokenizer))
    rest = {k: v for k, v in body.items() if k not in (*own, *CHAT_NEUTRAL)}
    if body.get("max_completion_tokens") is not None:
        rest["max_tokens"] = body["max_completion_tokens"]
    # Chat has no default length (OpenAI, vLLM): it runs to EOS, a stop, or the context's end.
    rest.setdefault("max_tokens", None)
    # Chat's form: logprobs is a switch, top_logprobs the alternatives (which need the switch on).
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS) if body.get("top_logprobs") is not None else 0
    if top and not wanted:
        raise InputError("top_logprobs needs logprobs: true")
    rest["logprobs"] = top if wanted else None
    return parse_completion({**rest, "prompt": prompt_ids}, tokenizer, model_name)


# OpenAI's /v1/responses, text only: its other fields at the values that change nothing here.
RESPONSES_NEUTRAL = {"tools": (None, []), "tool_choice": (None, "none", "auto"), "parallel_tool_calls": None,
                     "store": None, "metadata": None, "user": None, "service_tier": None,
                     "truncation": (None, "disabled"), "include": (None, []), "previous_response_id": (None,),
                     "reasoning": (None,), "text": (None, {"format": {"type": "text"}}), "background": (None, False),
                     "max_tool_calls": None, "top_logprobs": (None, 0), "prompt": (None,)}
TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses(body, tokenizer, model_name: str) -> CompletionParams:
    """OpenAI's Responses API, the text-only part: `input` (a string, or a list of messages whose
    content is a string or text parts) and `instructions` (a system message first) become a chat
    request; `max_output_tokens` is its max_tokens. Not streamed, not stored, no tools."""
    if not isinstance(body, dict):
        raise InputError('the request body must be a JSON object like {"input": "..."}')
    own = {"input", "instructions", "max_output_tokens", "temperature", "top_p", "model", "stream"}
    known = own | set(RESPONSES_NEUTRAL)
    unknown = sorted(set(body) - known)
    if unknown:
        raise InputError(f"unknown field {unknown[0]!r}; /v1/responses here reads {', '.join(sorted(own))} "
                         f"(text only; /v1/chat/completions has every sampling option)")
    for name, neutral in RESPONSES_NEUTRAL.items():
        if neutral is not None and body.get(name, neutral[0]) not in neutral:
            raise InputError(f"{name}={short_repr(body[name])} is not supported by this server's /v1/responses "
                             f"(text in, text out); leave it out")
    if _bool(body, "stream"):
        raise InputError("stream is not supported on /v1/responses here; use /v1/chat/completions with "
                         "\"stream\": true")
    turns = _response_input(body.get("input"))
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise InputError(f"instructions must be a string, got {short_repr(body['instructions'])}")
        turns = [{"role": "system", "content": body["instructions"]}, *turns]
    chat = {k: body[k] for k in ("model", "temperature", "top_p") if k in body}
    return parse_chat({**chat, "messages": turns, "max_tokens": body.get("max_output_tokens")}, tokenizer, model_name)


def _response_input(value) -> list[dict]:
    """Responses' `input` as chat messages: a string is one user message; list items are messages
    (type "message" or none) whose content is a string or input_text/output_text parts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InputError("input must be a string or a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            raise InputError(f"input[{i}] must be a message {{\"role\", \"content\"}} (text only here), "
                             f"got {short_repr(item)}")
        content = item.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str)
                       for p in content):
                raise InputError(f"input[{i}].content: only text parts ({', '.join(TEXT_PARTS)}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InputError(f"input[{i}].content must be a string or a list of text parts, got {short_repr(content)}")
        out.append({"role": item["role"], "content": content})
    return out


def messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise InputError(f"messages[{i}] must be {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}, "
                             f"got {short_repr(m)}")
        content = m.get("content")
        if isinstance(content, list):  # the parts form: only text parts
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InputError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InputError(f"messages[{i}].content must be a string, got {short_repr(content)}")
        _unicode(content, f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return out


def _template_kwargs(kwargs, tokenizer) -> dict:
    """vLLM's chat_template_kwargs (Qwen3's {"enable_thinking": false}): variables for the folder's
    template. A name of apply_chat_template's own arguments would change how it runs, and
    `messages` is the variable it sets itself: refused."""
    if kwargs is None:
        return {}
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k not in own for k in kwargs):
        raise InputError(f"chat_template_kwargs must be an object of template variables (not one of "
                         f"apply_chat_template's own arguments), got {short_repr(kwargs)}")
    return kwargs


def chat_prompt_ids(messages: list[dict], tokenizer, template_kwargs: dict | None = None) -> list[int]:
    """The ids the model continues from: the folder's chat template with the assistant's turn
    opened, or MINIMAL_TEMPLATE (which has no variables: template_kwargs change nothing there)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **(template_kwargs or {}))
        except jinja2.TemplateError as exc:
            # raise_exception("...") in the template raises TemplateError itself: the template refuses
            # these messages (a conversation without a user turn, a role it does not know), a 400 as
            # in vLLM. A subclass (a syntax error, an undefined name, the sandbox refusing) means a
            # broken template: the server's fault, left to the app's 500.
            if type(exc) is not jinja2.TemplateError:
                raise
            reason = (str(exc).strip().splitlines() or ["it gave no reason"])[0]
            raise InputError(f"the model's chat template refused these messages: {reason}") from None
        # A dict (harness.text_tokenizer) or a BatchEncoding (transformers 5) by default; a list before.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(MINIMAL_TEMPLATE.format(**m) for m in messages) + "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)


def _prompts(prompt, tokenizer, special: bool = False) -> list[list[int]]:
    """A string or a list of ids is one prompt; a list of those is a batch (OpenAI's form).
    special: the tokenizer adds its special tokens (a BOS) to a text prompt (vLLM's add_special_tokens)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InputError(f"prompt is a batch of {len(prompt)}; send at most {MAX_PROMPTS} prompts a request")
        return [_prompt(p, tokenizer, f"prompt[{i}]", special) for i, p in enumerate(prompt)]
    return [_prompt(prompt, tokenizer, "prompt", special)]


def _prompt(prompt, tokenizer, name: str, special: bool = False) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"{name} is empty; send some text or a list of token ids")
        if tokenizer is None:
            raise InputError("this model folder has no tokenizer; send the prompt as a list of token ids")
        _unicode(prompt, name)
        return tokenizer.encode(prompt, add_special_tokens=special)
    if isinstance(prompt, list):
        if not prompt:
            raise InputError(f"{name} is an empty list; send some text or token ids")
        return _ids(prompt, name)
    raise InputError(f"{name} must be a string or a list of token ids (or a list of those), "
                     f"got {type(prompt).__name__}")


def _ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise InputError(f"{name} must be a list of integer token ids, got {short_repr(value)}")
    return value  # the engine checks each against the vocabulary


MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # matched against every new token's text: bounded work per token


def _stop(stop) -> list[str]:
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InputError(f"stop must be a non-empty string or a list of them, got {short_repr(stop)}")
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InputError(f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    for s in stop:
        _unicode(s, "stop")
    return stop


SEED_LIMIT = 2**64  # torch.Generator seeds are unsigned 64-bit


def _seed(body: dict, choices: int) -> int | None:
    """The request's seed, or None; choice c draws with seed + c, which must stay a 64-bit seed."""
    if body.get("seed") is None:
        return None
    seed = body["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_LIMIT - choices:
        raise InputError(f"seed must be an integer in 0..2**64 - {choices} (choice c draws with seed + c), "
                         f"got {short_repr(seed)}")
    return seed


def _unicode(text: str, name: str) -> None:
    """JSON can carry a lone surrogate (\\ud800), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{name} holds a lone surrogate (an unpaired \\uD800-\\uDFFF escape); send valid "
                         f"Unicode") from None


def _int(body: dict, name: str, default, low: int, high: int | None = None) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise InputError(f"{name} must be an integer {span}, got {short_repr(value)}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        value = default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if open_low else value >= low) and value <= high
    if not ok:
        raise InputError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {short_repr(value)}")
    return float(value)


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InputError(f"{name} must be true or false, got {short_repr(value)}")
    return value
