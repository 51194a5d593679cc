"""The OpenAI completions request, checked field by field (lesson L11, §2.3 "The protocol").

Anything wrong is an `InputError` with one line that names the field, what it got and what it
wants; the app answers it with a 400 and an OpenAI-style error body. Nothing reaches the engine
thread unchecked except what only the engine can judge (the prompt's length against the pool).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from l1_contiguous import InputError
from l1_contiguous.errors import short_repr

from .engine import MAX_LOGPROBS, ServeItem

# Fields of OpenAI's /v1/completions this server ignores when they hold their neutral value.
NEUTRAL = {"best_of": (None, 1), "user": None, "suffix": (None,), "logit_bias": (None, {})}


MAX_PROMPTS = 64  # prompts in one request's batch: each takes a waiting slot and a group of samples


@dataclass
class CompletionParams:
    prompts: list[list[int]]  # one, or a batch: each runs as its own group of n samples
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int
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
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely
    echo: bool = False  # the prompt comes back before the completion (with its logprobs, if asked)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def work_items(self) -> list[ServeItem]:
        """One engine item per prompt, each with the request's sampling settings (and seed)."""
        # echo with max_tokens 0 scores the prompt: the engine still makes one token, never sent.
        return [ServeItem(prompt, max(self.max_tokens, 1), n=self.n, temperature=self.temperature,
                          seed=self.seed, top_p=self.top_p, stop_token_ids=tuple(self.stop_token_ids),
                          ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                          presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                          repetition_penalty=self.repetition_penalty, logprobs=self.logprobs,
                          prompt_logprobs=self.logprobs if self.echo else None)
                for prompt in self.prompts]


SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
                 "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty"}


def _check_fields(body: dict, own: set[str], neutral_values: dict) -> None:
    """Unknown fields are an error (a typo would be ignored silently); fields this server does not
    implement are accepted at their neutral value only."""
    known = SHARED_FIELDS | own | set(neutral_values)
    unknown = sorted(set(body) - known)
    if unknown:
        raise InputError(f"unknown field {unknown[0]!r}; this server reads {', '.join(sorted(known))}")
    for name, neutral in neutral_values.items():
        if neutral is not None and body.get(name, neutral[0]) not in neutral:
            raise InputError(f"{name}={short_repr(body[name])} is not supported by this server; leave it out")


def parse_completion(body, tokenizer, model_name: str) -> CompletionParams:
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object like {\"prompt\": \"...\", \"max_tokens\": 16}")
    _check_fields(body, {"prompt", "stop_token_ids", "logprobs", "echo"}, NEUTRAL)
    if body.get("model", model_name) not in (model_name, None):
        raise InputError(f"model {body['model']!r} is not served here; GET /v1/models lists {model_name!r}")
    if body.get("stop") and tokenizer is None:
        raise InputError("stop strings need a tokenizer and this model folder has none; use stop_token_ids")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise InputError("stream_options must be an object with at most include_usage and continuous_usage_stats "
                         "(booleans)")
    echo = _bool(body, "echo")
    max_tokens = _int(body, "max_tokens", 16, low=0 if echo else 1)  # 0: score the prompt, generate nothing
    return CompletionParams(
        prompts=_prompts(body.get("prompt"), tokenizer),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, low=0.0, high=2.0),
        top_p=_number(body, "top_p", 1.0, low=0.0, high=1.0, open_low=True),
        n=_int(body, "n", 1, low=1, high=16),
        seed=_int(body, "seed", None, low=0) if body.get("seed") is not None else secrets.randbelow(2**31),
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
        logprobs=_int(body, "logprobs", None, low=0, high=MAX_LOGPROBS) if body.get("logprobs") is not None else None,
        echo=echo)


CHAT_NEUTRAL = {**NEUTRAL, "echo": (False, None), "tools": (None, []),
                "tool_choice": (None, "none"), "parallel_tool_calls": None, "response_format": (None, {"type": "text"}),
                "store": (None, False), "metadata": None, "service_tier": None}
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
    _check_fields(body, {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}, CHAT_NEUTRAL)
    prompt_ids = chat_prompt_ids(messages(body.get("messages")), tokenizer)
    rest = {k: v for k, v in body.items()
            if k not in ("messages", "max_completion_tokens", "logprobs", "top_logprobs", *CHAT_NEUTRAL)}
    if body.get("max_completion_tokens") is not None:
        rest["max_tokens"] = body["max_completion_tokens"]
    # Chat's form: logprobs is a switch, top_logprobs the alternatives (which need the switch on).
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, low=0, high=MAX_LOGPROBS) if body.get("top_logprobs") is not None else 0
    if top and not wanted:
        raise InputError("top_logprobs needs logprobs: true")
    rest["logprobs"] = top if wanted else None
    return parse_completion({**rest, "prompt": prompt_ids}, tokenizer, model_name)


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


def chat_prompt_ids(messages: list[dict], tokenizer) -> list[int]:
    """The ids the model continues from: the folder's chat template with the assistant's turn
    opened, or MINIMAL_TEMPLATE."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
    text = "".join(MINIMAL_TEMPLATE.format(**m) for m in messages) + "assistant:"
    return tokenizer.encode(text, add_special_tokens=False)


def _prompts(prompt, tokenizer) -> list[list[int]]:
    """A string or a list of ids is one prompt; a list of those is a batch (OpenAI's form)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InputError(f"prompt is a batch of {len(prompt)}; send at most {MAX_PROMPTS} prompts a request")
        return [_prompt(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, tokenizer, "prompt")]


def _prompt(prompt, tokenizer, name: str) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"{name} is empty; send some text or a list of token ids")
        if tokenizer is None:
            raise InputError("this model folder has no tokenizer; send the prompt as a list of token ids")
        _unicode(prompt, name)
        return tokenizer.encode(prompt, add_special_tokens=False)
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
