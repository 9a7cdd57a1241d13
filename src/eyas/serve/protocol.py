"""The OpenAI request bodies eyas accepts (pydantic, strict: an unknown field or a wrong type is a 400), the
errors it answers with, and the response and chunk bodies it sends."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from eyas.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams


class ApiError(Exception):
    """An error the client caused (or may retry): sent as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("authentication_error" if status == 401 else
                             "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> ApiError:
    """A pydantic complaint, as a 400 naming the field: `top_k: Input should be a valid integer`."""
    err = max(e.errors(), key=lambda err: len(err["loc"]))  # in a union, the member that got furthest
    # loc names the field path, with the union member tried mixed in: ("prompt", "list[int]", 1) -> "prompt.1"
    param = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p in _UNION_TAGS or "[" in str(p)))
    param = param or None
    if err["type"] == "extra_forbidden":
        message = f"unknown field {param!r} (not supported by this server)"
    elif err["type"] == "value_error":  # our own validators: the message already names field and value
        message = str(err["ctx"]["error"])
    elif err["type"] == "missing":
        message = f"field {param!r} is required"
    else:
        got = err.get("input")
        shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
        message = f"{param}: {err['msg']} (got {shown})"
    return ApiError(400, message, param=param, code=err["type"])


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "TextPart"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


def _check_positive(value: int | None, name: str) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"{name} is {value}; expected a positive integer")
    return value


def _check_top(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} is {value}; expected 0..{MAX_LOGPROBS}")
    return value


class _Sampling(_Strict):
    """Fields shared by both endpoints. top_k, min_p, ignore_eos and return_token_ids are vLLM's extensions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    guided_regex: str | None = None  # vLLM's extension: the output matches this regular expression
    stop_token_ids: list[int] | None = None  # vLLM's extension: these token ids end the output too

    @field_validator("n")
    @classmethod
    def _only_one(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n is {n}; this server returns one choice per request (n=1)")
        return n

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, fmt: dict | None) -> dict | None:
        """The shape only; the schema itself is checked when it is compiled (sampling_params)."""
        if fmt is None:
            return fmt
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type is {kind!r}; expected 'text', 'json_object' or 'json_schema'")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema must be an object with a 'schema' object "
                                 "({'name': ..., 'schema': {...}, 'strict': true})")
        return fmt

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, seed: int | None) -> int | None:
        if seed is not None and not -2**63 <= seed < 2**64:
            raise ValueError(f"seed is {seed}; expected a 64-bit integer")
        return seed

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, max_tokens: int | None) -> int | None:
        return _check_positive(max_tokens, "max_tokens")

    def structured_output(self) -> StructuredOutputParams | None:
        """response_format or guided_regex as a spec; an invalid schema or regex is a 400 naming it."""
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text" and self.guided_regex is not None:
            raise ApiError(400, "response_format and guided_regex are both set; give one", param="guided_regex")
        try:
            if kind == "json_object":
                return StructuredOutputParams(json_object=True)
            if kind == "json_schema":
                return StructuredOutputParams(json_schema=self.response_format["json_schema"]["schema"])
            if self.guided_regex is not None:
                return StructuredOutputParams(regex=self.guided_regex)
        except ValueError as e:  # "structured_output json_schema is invalid: ..." -> named as the request names it
            if kind == "json_schema":
                name = self.response_format["json_schema"].get("name")
                message = str(e).replace("structured_output json_schema", f"response_format json_schema {name!r}")
                raise ApiError(400, message, param="response_format") from e
            raise ApiError(400, str(e).replace("structured_output regex", "guided_regex"), param="guided_regex") from e
        return None

    def num_logprobs(self) -> int | None:
        """Top log-probabilities per position the request asks for (None: no log-probabilities)."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams checks the values (temperature >= 0, 0 < top_p <= 1, ...); its message names the field."""
        structured = self.structured_output()
        try:
            return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
                                  stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                  structured_output=structured, logprobs=self.num_logprobs())
        except ValueError as e:
            first = str(e).split()[0]
            raise ApiError(400, str(e), param=first if first in type(self).model_fields else None) from e


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None  # the legacy form: this many top tokens per position, besides the chosen one

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, logprobs: int | None) -> int | None:
        return _check_top(logprobs, "logprobs")

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # needs logprobs: true

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, top: int | None) -> int | None:
        return _check_top(top, "top_logprobs")

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, max_tokens: int | None) -> int | None:
        return _check_positive(max_tokens, "max_completion_tokens")

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[Message]) -> list[Message]:
        if not messages:
            raise ValueError("messages is empty")
        return messages


# -- responses ----------------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


# One generated token's log-probabilities as the engine thread renders them (it owns the tokenizer):
# {"token": text of the token, "logprob": float, "top": [[text, logprob], ...] best first}
LogprobEntry = dict


def completion_logprobs(entries: list[LogprobEntry] | None, text_offset: int = 0) -> dict | None:
    """The legacy completions form: parallel lists, top tokens as {text: logprob} (a text repeated keeps its best)."""
    if entries is None:
        return None
    def top(pairs: list) -> dict:
        best: dict = {}
        for text, logprob in pairs:  # best first: a text repeated keeps its best log-probability
            best.setdefault(text, logprob)
        return best

    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [top(e["top"]) for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[LogprobEntry] | None) -> dict | None:
    """The chat form: one object per token with its UTF-8 bytes and its top alternatives."""
    if entries is None:
        return None

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [dict(one(e["token"], e["logprob"]), top_logprobs=[one(t, lp) for t, lp in e["top"]])
                        for e in entries], "refusal": None}


def completion_body(rid: str, model: str, text: str, finish_reason: str, num_prompt: int,
                    num_completion: int, token_ids: list[int] | None = None,
                    logprobs: list[LogprobEntry] | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(num_prompt, num_completion)}


def chat_body(rid: str, model: str, text: str, finish_reason: str, num_prompt: int,
              num_completion: int, token_ids: list[int] | None = None,
              logprobs: list[LogprobEntry] | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": chat_logprobs(logprobs),
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(num_prompt, num_completion)}
