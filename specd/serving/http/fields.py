"""Request bodies to engine inputs: every field the OpenAI routes read, checked at the edge.

Contract: these functions turn a request body into what the engine takes (prompt ids,
`SamplingParams`, stop strings, stream flags) or raise `ApiError` (or, for a sampling setting, the
`RequestRefused` of `SamplingParams`), a 4xx in OpenAI's error shape that names the field at fault
and says why. Whatever JSON a client sends (wrong types, huge or non-finite numbers, lone
surrogates, nesting too deep to parse) ends here as a 4xx; nothing a client sends reaches the
engine in a shape that could fail its step. The functions are plain and synchronous;
`completion_prompt_ids` and `chat_prompt_ids` cost time in proportion to the body, and the
handlers run them off the event loop (as they do `json_object` of a large body:
`specd.core.http_requests`).
"""

from __future__ import annotations

from typing import Any

from specd.core.errors import BadRequest
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget

MAX_TOKENS_CAP = 32_768
MAX_STOPS = 4


class ApiError(BadRequest):
    """An error answer with its own status and OpenAI's param, code and type fields (and headers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status, self.param, self.code, self.kind = status, param, code, kind
        self.headers = headers


def field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    """body[name] when it is one of `kinds` (a JSON boolean is not a number), `default` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be of type {expected}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = field(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer literal too large for a float
        raise ApiError(400, f"'{name}' must be a finite number, got an integer of {len(str(value))} digits",
                       param=name) from None


def _valid_text(text: str, param: str) -> str:
    """JSON can carry lone surrogates (\\ud800) that no tokenizer can encode: refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"'{param}' is not valid Unicode: a lone surrogate at character {error.start}",
                       param=param) from None
    return text


def include_usage(body: dict[str, Any]) -> bool:
    """OpenAI's `stream_options: {"include_usage": true}`: a last chunk with the token counts."""
    options = field(body, "stream_options", (dict,), {})
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise ApiError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return include


# OpenAI (and vLLM) fields this server does not implement, with the values that ask for nothing:
# any other value is refused by name, since ignoring it would answer something the client did not ask for
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",),
    "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    # vLLM's own sampling and output extras, which vLLM clients send
    "top_k": (-1, 0), "min_p": (0,), "min_tokens": (0,), "ignore_eos": (False,), "stop_token_ids": ([],),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "use_beam_search": (False,),
    "length_penalty": (1,), "bad_words": ([],), "allowed_token_ids": (), "prompt_logprobs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming the first field in `UNSUPPORTED` set to anything but null or a value asking for nothing."""
    for name, harmless in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(_same_json(value, h) for h in harmless):
            raise ApiError(400, f"'{name}' is not supported by this server (send it as null or leave it out)",
                           param=name)


def _same_json(value: Any, expected: Any) -> bool:
    """JSON equality: 0 and 0.0 alike, a boolean never equal to a number (Python alone takes True for 1)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return value is expected
    if isinstance(value, (int, float)) and isinstance(expected, (int, float)):
        return value == expected
    return type(value) is type(expected) and value == expected


def sampling(body: dict[str, Any], default_max_tokens: int) -> tuple[SamplingParams, list[str], bool]:
    """The sampling settings, stop strings and stream flag of a request."""
    if field(body, "n", (int,), 1) != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    refuse_unsupported(body)
    max_tokens = field(body, "max_tokens", (int,), None)
    newer_name = field(body, "max_completion_tokens", (int,), default_max_tokens)  # checked even when unused
    if max_tokens is None:
        max_tokens = newer_name
    if not 1 <= max_tokens <= MAX_TOKENS_CAP:
        shown = max_tokens if abs(max_tokens) < 10**12 else f"an integer of {len(str(max_tokens))} digits"
        raise ApiError(400, f"'max_tokens' must be between 1 and {MAX_TOKENS_CAP}, got {shown}", param="max_tokens")
    stop = field(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings",
                       param="stop")
    temperature, top_p = _number(body, "temperature", 1.0), _number(body, "top_p", 1.0)
    # a setting SamplingParams refuses raises RequestRefused, a 400 naming its field as ApiError does
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                            seed=field(body, "seed", (int,), None))
    return params, [_valid_text(s, "stop") for s in stops], bool(field(body, "stream", (bool,), False))


def check_model(body: dict[str, Any], served: str) -> None:
    model = field(body, "model", (str,), served)
    if model != served:
        raise ApiError(404, f"the model '{model[:200]}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


def completion_prompt_ids(loaded: LoadedTarget, prompt: Any) -> list[int]:
    """A completion's `prompt` (a string, a list with one string, or token ids) as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return loaded.encode(_valid_text(prompt, "prompt"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)  # the engine checks that they are inside the vocabulary
    raise ApiError(400, "'prompt' must be a string, a list with one string, or a list of token ids", param="prompt")


def chat_prompt_ids(loaded: LoadedTarget, messages: Any) -> list[int]:
    """A chat's `messages` through the target's chat template, as token ids."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    texts = [{"role": _valid_text(m["role"], "messages"), "content": _message_text(m)} for m in messages]
    try:
        return loaded.encode_messages(texts)
    except Exception as error:  # a chat template can reject role orders it does not know
        raise ApiError(400, f"the chat template refused these messages: {error}", param="messages") from None


def _message_text(message: dict[str, Any]) -> str:
    # OpenAI lets an assistant turn's content be null (it called a tool instead): no text
    if message["role"] == "assistant" and message.get("content") is None:
        return ""
    return _text_content(message.get("content"))


def _text_content(content: Any) -> str:
    """A message's content as text: a string, or OpenAI's list of parts, of which text parts only."""
    if isinstance(content, str):
        return _valid_text(content, "messages")
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        others = sorted({str(part.get("type"))[:40] for part in content if part.get("type") != "text"})
        if others:
            raise ApiError(400, f"only text content parts are supported, got {others}", param="messages")
        if not all(isinstance(part.get("text"), str) for part in content):
            raise ApiError(400, "a text content part's 'text' must be a string", param="messages")
        return _valid_text("".join(part["text"] for part in content), "messages")
    raise ApiError(400, "a message's 'content' must be a string or a list of {type: text, text} parts",
                   param="messages")
