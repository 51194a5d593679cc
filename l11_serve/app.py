"""The HTTP side (lesson L11, §2.1 and §2.3): routes, a request's life as a stream of server-sent events.

    POST /v1/completions   OpenAI's completions: text or ids in, text out (streamed or whole)
    POST /v1/chat/completions  OpenAI's chat: messages through the chat template, then the same
    POST /v1/responses     OpenAI's Responses API, text only and whole: input -> output_text
    POST /tokenize, /detokenize  vLLM's shapes: text or messages -> ids, ids -> text
    GET  /v1/models        the one model served (and /v1/models/{id})
    GET  /health           200 while the engine loop runs
    GET  /metrics          Prometheus text format
    GET  /pool             the block pool and queues as JSON (what the page draws)
    GET  /                 the live page of the pool
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from l1_contiguous import InputError
from l1_contiguous.errors import one_line

from .loop import EngineLoop, Stream
from .protocol import CompletionParams, chat_prompt_ids, parse_chat, parse_completion, parse_responses
from .protocol import messages as parse_messages
from .stops import StopMatcher

log = logging.getLogger("l11_serve")
STATIC = Path(__file__).parent / "static"
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "aborted": "abort", "error": "error"}


@dataclass
class ServerConfig:
    model_name: str
    max_waiting: int = 64  # HTTP requests accepted but without a first token yet; one more is a 429


@dataclass
class Choice:
    """One sample's text as the client sees it."""

    matcher: StopMatcher
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # a TokenLogprob per id kept, when asked
    prompt_ids: list[int] | None = None  # echo: the prompt, sent back before the completion
    prompt_logprobs: list | None = None  # echo with logprobs: one per prompt token (None for the first)
    sends_tokens: bool = True  # False: echo with max_tokens 0 (the engine's one token is not sent)


POOL_VIEW_WAIT_S = 1.0  # /pool waits this long for the engine thread's block view (between two steps)
MAX_BODY_BYTES = 4 * 2**20  # a prompt of the largest context is far smaller; more is a mistake or an attack


class BodyTooLarge(Exception):
    pass


async def _body_within_limit(request: Request) -> bytes:
    """The body, read chunk by chunk and refused past MAX_BODY_BYTES (a missing or false
    Content-Length cannot make the server hold more)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def _not_found(request: Request, exc) -> JSONResponse:
    return error(404, f"no route {request.method} {request.url.path}; this server has POST /v1/completions, "
                      f"/v1/chat/completions, /v1/responses, /tokenize and /detokenize, GET /v1/models, "
                      f"/health, /metrics, /pool and /")


async def _not_allowed(request: Request, exc) -> JSONResponse:
    return error(405, f"{request.method} is not allowed on {request.url.path}",
                 headers={"Allow": exc.headers.get("Allow", "")} if getattr(exc, "headers", None) else None)


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's own if it sent one, else a new one (a
    pure ASGI middleware, so streamed responses are not buffered)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = given[:128] if given and given.isascii() else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}; `code` is a string or
    null there (the HTTP status carries the number), so null here."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def _not_running(loop: EngineLoop) -> str:
    return f"the engine loop is not running ({one_line(loop.error) if loop.error else 'stopped'})"


def create_app(loop: EngineLoop, tokenizer, config: ServerConfig) -> Starlette:
    waiting = {"count": 0}  # streams without their first token (asyncio thread only)

    def refuse(status: int, message: str) -> JSONResponse:
        """A request the client must change (400, 413): answered and counted."""
        loop.metrics.rejected.labels("bad_request" if status == 400 else "too_large").inc()
        return error(status, message)

    async def completions(request: Request) -> Response:
        return await serve(request, parse_completion, TEXT)

    async def chat_completions(request: Request) -> Response:
        return await serve(request, parse_chat, CHAT)

    async def responses(request: Request) -> Response:
        return await serve(request, parse_responses, RESPONSES)

    async def serve(request: Request, parse, shape: "Shape") -> Response:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return refuse(413, f"the body has {int(declared):,} bytes; the limit is {MAX_BODY_BYTES:,}")
        try:
            raw = await _body_within_limit(request)
            # Decoding, checking and tokenizing a large body take time: on a worker thread, so that
            # every other stream's tokens keep flowing meanwhile (a 10 MB prompt once held them 66 s).
            body = await asyncio.to_thread(json.loads, raw or b"null")
            params = await asyncio.to_thread(parse, body, tokenizer, config.model_name)
        except ClientDisconnect:  # gone before its body arrived: nothing was queued, nobody to answer
            return Response(status_code=499)
        except BodyTooLarge:
            return refuse(413, f"the body is over the limit of {MAX_BODY_BYTES:,} bytes")
        # InputError, JSONDecodeError and UnicodeDecodeError are ValueErrors: each before ValueError,
        # or every field's own message would read as an unreadable body.
        except InputError as exc:
            return refuse(400, str(exc))
        except json.JSONDecodeError as exc:
            return refuse(400, f"the body is not valid JSON ({exc.msg} at character {exc.pos})")
        except UnicodeDecodeError:
            return refuse(400, "the body is not UTF-8 text; send JSON encoded as UTF-8")
        except RecursionError:
            return refuse(400, "the body nests too deeply to be a completion request")
        except ValueError as exc:  # e.g. an integer of thousands of digits
            return refuse(400, f"the body cannot be read as a completion request ({one_line(exc)})")
        items = params.work_items(loop.engine.max_model_len)
        if waiting["count"] + len(items) > config.max_waiting:  # backpressure: refuse now, not queue forever
            loop.metrics.rejected.labels("overloaded").inc()
            return error(429, f"the server has {waiting['count']} requests waiting and takes {config.max_waiting}; "
                         f"this one brings {len(items)}; retry later", "rate_limit_error", headers={"Retry-After": "1"})
        if not loop.alive:
            return error(503, f"{_not_running(loop)}; see the server's log", "server_error")
        # The slots are taken before the first await: a burst cannot pass the check above together.
        waiting["count"] += len(items)
        streams = loop.submit_batch(items)
        try:
            for stream in streams:
                await asyncio.wrap_future(stream.accepted)
        except InputError as exc:  # what only the engine could judge (too long, a pool too small): none runs
            waiting["count"] -= len(items)
            return refuse(400, str(exc))
        except BaseException:  # the client left (cancelled) before the engine took every prompt
            waiting["count"] -= len(items)
            for stream in streams:
                loop.abort(stream)
            raise
        # Prompt k's samples are choices k*n .. k*n + n-1 (OpenAI's numbering for a batch).
        groups = [[Choice(StopMatcher(tokenizer, params.stop) if tokenizer else None,
                          prompt_ids=prompt if params.echo else None, sends_tokens=params.max_tokens != 0)
                   for _ in range(params.n)] for prompt in params.prompts]
        choices = [c for group in groups for c in group]
        steps = _merged([_choice_steps(loop, stream, group, waiting) for stream, group in zip(streams, groups)],
                        params.n)
        rid, created = f"{shape.id_prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        head = {"id": rid, "object": shape.chunk_object if params.stream else shape.object, "created": created,
                "model": config.model_name}
        if params.stream:
            return StreamingResponse(_sse(steps, head, params, choices, shape, tokenizer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, steps, head, params, choices, shape, tokenizer)

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": 0, "owned_by": "kv-cache-course",
                "max_model_len": loop.engine.max_model_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request: Request) -> Response:
        if request.path_params["model_id"] != config.model_name:
            return error(404, f"no model {request.path_params['model_id']!r} here; GET /v1/models lists "
                              f"the one served, {config.model_name!r}")
        return JSONResponse(model_card())

    async def tokenize(request: Request) -> Response:
        """vLLM's shape: {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
        try:
            body = json.loads(await _body_within_limit(request) or b"null")
            if tokenizer is None:
                raise InputError("this model folder has no tokenizer")
            if not isinstance(body, dict) or not (isinstance(body.get("prompt"), str) or "messages" in body):
                raise InputError('send {"prompt": "text"} or {"messages": [...]}')
            ids = (chat_prompt_ids(parse_messages(body["messages"]), tokenizer) if "messages" in body
                   else tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens"))))
        except (BodyTooLarge, ValueError, RecursionError, InputError) as exc:
            return error(400, str(exc) if isinstance(exc, InputError) else "the body is not a tokenize request")
        return JSONResponse({"count": len(ids), "max_model_len": loop.engine.max_model_len,
                             "tokens": ids})

    async def detokenize(request: Request) -> Response:
        """{"tokens": [ids]} -> {"prompt": text}."""
        try:
            body = json.loads(await _body_within_limit(request) or b"null")
            if tokenizer is None:
                raise InputError("this model folder has no tokenizer")
            vocab = loop.engine.model.config.vocab_size
            ids = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    and 0 <= i < vocab for i in ids):
                raise InputError(f'send {{"tokens": [ids in 0..{vocab - 1}]}}')
        except (BodyTooLarge, ValueError, RecursionError, InputError) as exc:
            return error(400, str(exc) if isinstance(exc, InputError) else "the body is not a detokenize request")
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def health(request: Request) -> Response:
        if loop.alive:
            return JSONResponse({"status": "ok"})
        return error(503, _not_running(loop), "server_error")

    async def metrics(request: Request) -> Response:
        return Response(loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def pool(request: Request) -> Response:
        try:
            view = await asyncio.wait_for(asyncio.wrap_future(loop.pool_view()), timeout=POOL_VIEW_WAIT_S)
        except asyncio.TimeoutError:  # a step longer than that: the last snapshot, without the blocks
            view = {**loop.snapshot, "blocks": None}
        return JSONResponse({**view, "waiting_http": waiting["count"]})

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "pool.html")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        yield
        await asyncio.to_thread(loop.stop)

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/responses", responses, methods=["POST"]), Route("/v1/models", models),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/v1/models/{model_id:path}", one_model),
              Route("/health", health), Route("/metrics", metrics), Route("/pool", pool), Route("/", page)]
    handlers = {404: _not_found, 405: _not_allowed}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                     middleware=[Middleware(RequestIdMiddleware)])


async def _choice_steps(loop: EngineLoop, stream: Stream, choices: list[Choice], waiting: dict):
    """Per engine step: the list of (index, text, new ids, finish, their logprobs) for the choices it changed.
    On the way out (finished, client gone, server stopping) the samples still running are aborted."""
    first = True
    try:
        while any(c.finish_reason is None for c in choices):
            updates = await stream.events.get()
            if first:
                waiting["count"], first = waiting["count"] - 1, False
            out = []
            for u in updates:
                c = choices[u.index]
                if c.finish_reason is not None:
                    continue  # a stop string ended it already; this is the engine's abort coming back
                if u.prompt_logprobs is not None:
                    c.prompt_logprobs = u.prompt_logprobs
                if not c.sends_tokens:
                    text, kept = "", 0
                else:
                    text = c.matcher.feed(u.token_ids) if c.matcher else ""
                    kept = c.matcher.num_tokens - len(c.token_ids) if c.matcher else len(u.token_ids)
                c.token_ids += u.token_ids[:kept]
                c.logprobs += u.logprobs[:kept]
                if c.matcher and c.matcher.stopped:
                    c.finish_reason = "stop"
                    loop.abort(stream, u.index, reason="stop")  # it ended on its stop string, not aborted
                elif u.finish_reason:
                    c.finish_reason = FINISH.get(u.finish_reason, u.finish_reason)  # an engine error reason as is
                    text += c.matcher.flush() if c.matcher and c.sends_tokens else ""
                out.append((u.index, text, u.token_ids[:kept], c.finish_reason, u.logprobs[:kept]))
            if out:
                yield out
    finally:
        if first:
            waiting["count"] -= 1
        if any(c.finish_reason is None for c in choices):
            loop.abort(stream)  # the client left (or the server stops): give every block back


async def _merged(generators: list, n: int):
    """The steps of every prompt's `_choice_steps` as they come, each choice's index moved to its
    place in the batch (prompt k's sample i is k*n + i). Closing this closes them all, which aborts
    whatever still runs; a failure in one ends the whole."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, steps):
        try:
            async for out in steps:
                queue.put_nowait([(k * n + i, *rest) for i, *rest in out])
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(k, steps)) for k, steps in enumerate(generators)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for steps in generators:
            await steps.aclose()


def _usage(params: CompletionParams, choices: list[Choice]) -> dict:
    out = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": params.prompt_tokens, "completion_tokens": out, "total_tokens": params.prompt_tokens + out}


@dataclass(frozen=True)
class Shape:
    """How the two APIs dress the same choices: completions carry `text`, chat a message (whole)
    or a `delta` (streamed, the role in each choice's first chunk)."""

    object: str
    chunk_object: str
    id_prefix: str
    chat: bool
    responses: bool = False  # OpenAI's Responses API: one output message (see _response)

    def streamed(self, i: int, text: str, ids: list[int], finish, logprobs=None) -> dict:
        if not self.chat:
            return {"index": i, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "delta": {"content": text} if text else {}, "token_ids": ids, "logprobs": logprobs,
                "finish_reason": finish}

    def opening(self, i: int) -> dict | None:
        """Chat's first chunk of a choice: the role alone, as OpenAI sends it."""
        if not self.chat:
            return None
        return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def whole(self, i: int, text: str, ids: list[int], finish, logprobs=None) -> dict:
        if not self.chat:
            return {"index": i, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "message": {"role": "assistant", "content": text}, "token_ids": ids,
                "logprobs": logprobs, "finish_reason": finish}

    def logprobs(self, entries: list, ids: list[int], tokenizer, offset: int = 0) -> dict:
        """OpenAI's logprobs object for these tokens: completions' four parallel lists (text_offset
        counts characters of the tokens' own texts from `offset`), chat's `content` list."""
        texts = [token_text(tokenizer, t) for t in ids]
        if not self.chat:  # an entry of None: the prompt's first token (echo), which nothing predicts
            offsets = [offset + sum(map(len, texts[:j])) for j in range(len(texts))]
            return {"tokens": texts, "token_logprobs": [e and e.logprob for e in entries],
                    "top_logprobs": [e and {token_text(tokenizer, t): v for t, v in e.top} for e in entries],
                    "text_offset": offsets}

        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(text, e.logprob), "top_logprobs": [entry(token_text(tokenizer, t), v)
                                                                          for t, v in e.top]}
                            for text, e in zip(texts, entries)]}


def token_text(tokenizer, token_id: int) -> str:
    """A token's own text (a piece of a multi-byte character decodes to U+FFFD, as OpenAI's does to
    bytes); without a tokenizer, vLLM's `token_id:N`."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


TEXT = Shape("text_completion", "text_completion", "cmpl", chat=False)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)
RESPONSES = Shape("response", "response", "resp", chat=True, responses=True)


def _response(head: dict, text: str, choice: Choice, params: CompletionParams) -> dict:
    """The Responses API's body: one assistant message of one output_text part. `incomplete` when
    the length ran out (max_output_tokens, or the context's end); `failed` for an abort or error."""
    status = {"stop": "completed", "length": "incomplete"}.get(choice.finish_reason, "failed")
    out = len(choice.token_ids)
    return {"id": head["id"], "object": "response", "created_at": head["created"], "model": head["model"],
            "status": status, "error": None if status != "failed" else
            {"code": "server_error", "message": f"the generation ended with {choice.finish_reason}"},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None, "max_output_tokens": params.max_tokens, "metadata": {},
            "output": [{"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "role": "assistant",
                        "status": "completed" if status == "completed" else "incomplete",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "parallel_tool_calls": False, "temperature": params.temperature, "top_p": params.top_p,
            "tool_choice": "none", "tools": [],
            "usage": {"input_tokens": params.prompt_tokens, "output_tokens": out,
                      "total_tokens": params.prompt_tokens + out,
                      # not tracked per request here: 0 means "not reported", not "no hit"
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


async def _sse(steps, head: dict, params: CompletionParams, choices: list[Choice], shape: Shape = TEXT,
               tokenizer=None):
    """Per engine step, one event for each choice it advanced (one choice per chunk, as OpenAI and
    vLLM send for n > 1: clients read `chunk.choices[0]` and its `index`), then usage if asked,
    then [DONE]. If making the text fails, an OpenAI-style error event ends the stream instead of
    a cut connection."""
    started: set[int] = set()
    offsets = [0] * len(choices)  # characters of each choice's tokens sent so far (text_offset)
    try:
        async for out in steps:
            for i, text, ids, finish, entries in out:
                if i not in started and shape.opening(i) is not None:
                    yield f"data: {json.dumps({**head, 'choices': [shape.opening(i)]})}\n\n"
                if i not in started and params.echo:  # the prompt first, in a chunk of its own
                    echo_text, echo_entries, echo_ids = _echoed(choices[i], tokenizer)
                    logprobs = shape.logprobs(echo_entries, echo_ids, tokenizer) if params.logprobs is not None else None
                    offsets[i] = sum(len(token_text(tokenizer, t)) for t in echo_ids)
                    yield f"data: {json.dumps({**head, 'choices': [shape.streamed(i, echo_text, [], None, logprobs)]})}\n\n"
                started.add(i)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = shape.logprobs(entries, ids, tokenizer, offsets[i])
                    offsets[i] += sum(len(token_text(tokenizer, t)) for t in ids)
                chunk = {**head, "choices": [shape.streamed(i, text, ids, finish, logprobs)]}
                if params.continuous_usage:  # vLLM's stream_options.continuous_usage_stats
                    chunk["usage"] = _usage(params, choices)
                elif params.include_usage:  # OpenAI: null in every chunk but the last
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as exc:
        log.exception("a completion stream failed")
        body = {"error": {"message": f"the server failed: {one_line(exc)}", "type": "server_error",
                          "param": None, "code": None}}
        yield f"data: {json.dumps(body)}\n\n"
        return
    if params.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(params, choices)})}\n\n"
    yield "data: [DONE]\n\n"


async def _whole(request: Request, steps, head: dict, params: CompletionParams, choices: list[Choice],
                 shape: Shape = TEXT, tokenizer=None) -> Response:
    """Collect every step, or stop as soon as the client hangs up (then the samples are aborted)."""
    texts = [""] * len(choices)

    async def collect():
        async for out in steps:
            for i, text, *_ in out:
                texts[i] += text

    async def hang_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.ensure_future(collect())
    done, pending = await asyncio.wait([collecting, asyncio.ensure_future(hang_up())],
                                       return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await steps.aclose()  # runs its finally: aborts whatever still runs
    if collecting in done and collecting.exception() is not None:  # our failure, not the client's
        log.error("a completion failed", exc_info=collecting.exception())
        return error(500, f"the server failed: {one_line(collecting.exception())}", "server_error")
    if any(c.finish_reason is None for c in choices):
        return error(499, "client closed the request", "client_closed")  # nobody reads it

    if shape.responses:  # one prompt, n = 1, no echo or logprobs: see parse_responses
        return JSONResponse(_response(head, texts[0], choices[0], params))

    def whole(i: int, c: Choice) -> dict:
        echo_text, echo_entries, echo_ids = _echoed(c, tokenizer)
        logprobs = (shape.logprobs(echo_entries + c.logprobs, echo_ids + c.token_ids, tokenizer)
                    if params.logprobs is not None else None)
        return shape.whole(i, echo_text + texts[i], c.token_ids, c.finish_reason, logprobs)

    body = {**head, "choices": [whole(i, c) for i, c in enumerate(choices)], "usage": _usage(params, choices)}
    return JSONResponse(body)


def _echoed(c: Choice, tokenizer) -> tuple[str, list, list[int]]:
    """With echo, what goes before the completion: the prompt's text, its logprob entries (when
    asked; None for the first token) and its ids. Without echo, nothing."""
    if c.prompt_ids is None:
        return "", [], []
    text = tokenizer.decode(c.prompt_ids) if tokenizer is not None else ""
    return text, list(c.prompt_logprobs or []), list(c.prompt_ids)
