"""OpenAI request bodies in, the runtime's `SamplingParams` out; OpenAI response and error bodies.

Request shapes follow the OpenAI API reference (chat completions and legacy completions). The
bodies are pydantic models (strict numbers, so `"max_tokens": "9"` is refused, not coerced); what
pydantic cannot say (parameters we do not support, roles, the chat template) is checked in
`to_request`, which raises `ProtocolError` naming the parameter. Parameters at their no-op value
(`n` = 1, `logprobs` false, penalties 0, `user`, ...) are accepted because ordinary clients send
them; any other value of an unsupported parameter is a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..runtime.request import MAX_NEW_TOKENS_LIMIT, SamplingParams

__all__ = ["ProtocolError", "ChatCompletionRequest", "CompletionRequest", "ParsedRequest", "parse_body",
           "error_body", "FINISH_REASONS", "MAX_STOP_STRINGS", "MAX_STOP_CHARS"]

#: stop strings per request at most, and characters per stop string (each is matched against the whole
#: decoded output at every committed token, so the list's size is a per-token cost; OpenAI allows 4)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

#: the runtime's finish reasons → OpenAI's ("capacity": the engine's context filled up, which a client
#: handles as "length"; "cancelled" is only ever seen by a client that already left)
FINISH_REASONS = {"stop": "stop", "length": "length", "capacity": "length", "cancelled": "stop", "error": "error"}


class ProtocolError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, the offending `param`."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


Number = Union[StrictInt, StrictFloat]


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are refused (extra="forbid") so a parameter we
    do not know is named, not dropped."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    # extras (as vLLM's): top-k sampling and a per-request verification policy
    top_k: StrictInt | None = None
    policy: StrictStr | None = None
    # accepted at their no-op value only (checked in `_check_unsupported`)
    n: StrictInt | None = None
    logprobs: Any = None
    top_logprobs: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[_TextPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


#: chat roles the chat template takes ("developer" is OpenAI's newer name for "system")
CHAT_ROLES = ("system", "developer", "user", "assistant")


@dataclass
class ParsedRequest:
    """One validated request: prompt ids, sampling parameters, and how to answer it."""

    kind: Literal["chat", "completion"]
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    policy: str | None
    stream: bool
    include_usage: bool
    id: str
    created: int


def _check_unsupported(req: _Common) -> None:
    """400 naming a parameter we do not implement when it is set to anything but its no-op value."""
    # logprobs: only null/false is a no-op; on /v1/completions an integer asks for that many alternatives
    # besides the sampled token's own logprob, so 0 is a request too (0 == False must not pass)
    if req.logprobs is not None and req.logprobs is not False:
        raise ProtocolError(f"logprobs: not supported by this server (accepted only as null or false); found "
                            f"{req.logprobs!r}", param="logprobs")
    noop = {"n": 1, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0,
            "logit_bias": {}, "tools": [], "functions": [], "tool_choice": "none", "function_call": "none",
            "echo": False, "best_of": 1, "suffix": "", "store": False}
    for name, default in noop.items():
        value = getattr(req, name, None)
        if value is not None and value != default:
            raise ProtocolError(f"{name}: not supported by this server (accepted only at its no-op value "
                                f"{default!r}); found {value!r}", param=name)
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.get("type") != "text":
        raise ProtocolError(f"response_format: only {{'type': 'text'}} is supported; found {fmt!r}",
                            param="response_format")
    if req.stream_options is not None:
        unknown = sorted(set(req.stream_options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise ProtocolError(f"stream_options: unknown keys {unknown}; expected include_usage",
                                param="stream_options")
        if not req.stream:
            raise ProtocolError("stream_options: only allowed with stream: true", param="stream_options")
        bad = {k: v for k, v in req.stream_options.items() if not isinstance(v, bool) and v is not None}
        if bad:
            raise ProtocolError(f"stream_options: expected true or false; found {bad}", param="stream_options")


def _stop_strings(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise ProtocolError(f"stop: at most {MAX_STOP_STRINGS} stop strings; found {len(stops)}", param="stop")
    for s in stops:
        if not s:
            raise ProtocolError("stop: stop strings must be non-empty; found ''", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise ProtocolError(f"stop: a stop string has at most {MAX_STOP_CHARS} characters; found {len(s)}",
                                param="stop")
    return stops


def _sampling_params(req: _Common, max_tokens: int | None, default_max: int) -> SamplingParams:
    if max_tokens is not None and not 1 <= max_tokens <= MAX_NEW_TOKENS_LIMIT:
        name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        raise ProtocolError(f"{name}: expected an integer in [1, {MAX_NEW_TOKENS_LIMIT}]; found {max_tokens}",
                            param=name)
    temperature = 1.0 if req.temperature is None else float(req.temperature)   # OpenAI's default
    checks = [("temperature", temperature, temperature >= 0 and temperature == temperature, "a value >= 0"),
              ("top_p", req.top_p, req.top_p is None or 0 < req.top_p <= 1, "a value in (0, 1]"),
              ("top_k", req.top_k, req.top_k is None or req.top_k >= 0, "an integer >= 0 (0 = off)"),
              ("seed", req.seed, req.seed is None or req.seed >= 0, "an integer >= 0")]
    for name, value, ok, expected in checks:
        if not ok:
            raise ProtocolError(f"{name}: expected {expected}; found {value!r}", param=name)
    return SamplingParams(max_new_tokens=max_tokens if max_tokens is not None else default_max,
                          temperature=temperature, top_k=req.top_k or 0,
                          top_p=1.0 if req.top_p is None else float(req.top_p), seed=req.seed,
                          stop=_stop_strings(req.stop))


def _chat_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ProtocolError(f"messages[{i}].role: expected one of {list(CHAT_ROLES)}; found {m.role!r}",
                                param=f"messages[{i}].role")
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise ProtocolError(f"messages[{i}].content[{j}]: only text parts are supported; found type "
                                        f"{part.type!r}", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        elif m.content is None:
            raise ProtocolError(f"messages[{i}].content: expected text; found null", param=f"messages[{i}].content")
        else:
            content = m.content
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
    """The first pydantic error as "field: what is wrong; found X" and the field's dotted name."""
    e = err.errors()[0]
    loc = [str(p) for p in e.get("loc", ())]
    # unions report each member's failure under the member's type name; keep the field path only
    path = [p for p in loc if not any(c in p for c in "[]") and p not in
            ("str", "int", "float", "bool", "list", "dict", "function-after")]
    # list indices as messages[0].role, the form the server's own checks use
    name = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path).lstrip(".") or "body"
    if e.get("type") == "extra_forbidden":
        return f"{name}: unknown parameter (not part of the OpenAI API this server implements)", name
    if e.get("type") == "missing":
        return f"{name}: required parameter missing", name
    found = repr(e.get("input"))
    return f"{name}: {e.get('msg', 'invalid')}; found {found[:80]}", name


def parse_body(kind: Literal["chat", "completion"], body: Any, runtime, served_model: str) -> ParsedRequest:
    """Validate a decoded JSON body and turn it into prompt ids and SamplingParams.

    Args:
        kind: "chat" (/v1/chat/completions) or "completion" (/v1/completions).
        body: the decoded JSON value.
        runtime: the `Runtime` (its tokenizer encodes the prompt / applies the chat template).
        served_model: the one model id this server answers to.
    Raises:
        ProtocolError: 400 (bad or unsupported parameter, unknown role) or 404 (unknown model).
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"body: expected a JSON object; found {type(body).__name__}")
    model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise ProtocolError(message, param=param) from None
    if req.model != served_model:
        raise ProtocolError(f"model: the model {req.model!r} does not exist; this server serves {served_model!r}",
                            status=404, param="model", code="model_not_found")
    _check_unsupported(req)
    tok = runtime.tokenizer
    if kind == "chat":
        messages = _chat_messages(req)
        if not getattr(tok, "chat_template", None):
            raise ProtocolError("messages: this engine directory's tokenizer has no chat template; use "
                                "/v1/completions", param="messages")
        try:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
        except Exception as e:  # noqa: BLE001 - a template may raise anything on a message order it refuses
            raise ProtocolError(f"messages: the chat template refused them ({type(e).__name__}: {e})",
                                param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ProtocolError(f"prompt: one prompt per request; found a batch of {len(prompt)}",
                                    param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ProtocolError("prompt: expected text; found an empty string", param="prompt")
            ids = runtime.encode(prompt, False)
        else:
            ids = list(prompt)
        max_tokens = req.max_tokens
    if not ids:
        raise ProtocolError("prompt: expected at least one token; found an empty prompt", param="prompt")
    max_context = int(runtime.engines.manifest.runtime["max_context"])
    if len(ids) + 1 > max_context:
        field = "messages" if kind == "chat" else "prompt"
        raise ProtocolError(f"{field}: the prompt's {len(ids)} tokens exceed the model's context of {max_context} "
                            f"tokens (prompt + at least 1 generated token)", param=field,
                            code="context_length_exceeded")
    # no max_tokens: generate until a stop or the context is full (finish_reason "length")
    params = _sampling_params(req, max_tokens, default_max=max_context - len(ids))
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return ParsedRequest(kind, served_model, ids, params, req.policy, bool(req.stream),
                         bool((req.stream_options or {}).get("include_usage")),
                         f"{prefix}-{uuid.uuid4().hex}", int(time.time()))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(req: ParsedRequest, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int) -> dict:
    """The non-streaming response (chat.completion or text_completion)."""
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(req: ParsedRequest, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
    """One streamed chunk (chat.completion.chunk or text_completion); the first chat chunk carries the role."""
    if req.kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the request's usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
