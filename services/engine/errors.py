"""The one exception for a client's mistake, typed so no caller ever reads its message.

:class:`RequestError` carries the sentence for the client and two typed fields: which part of the
request is wrong (:class:`Field`) and what is wrong with it (:class:`ErrorCode`). The target maps
it to a gRPC status in one place (specd.services.target.convert) and the gateway maps that to an
OpenAI error body in one place (specd.gateway.errors): rewording a message changes only the
message.
"""

from __future__ import annotations

import enum


class Field(enum.Enum):
    """The part of a request an error is about."""

    NONE = "none"  # the request as a whole, or a field with no OpenAI counterpart
    PROMPT = "prompt"  # the prompt, whatever form it took (text, chat messages, token ids)
    MESSAGES = "messages"  # chat messages specifically (an empty list, a template that refuses them)
    SPECULATION = "speculation"


class ErrorCode(enum.Enum):
    """What is wrong with it."""

    INVALID_VALUE = "invalid_value"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A request the engine will not serve as asked; the client can fix it and retry.

    A ValueError, so code that treats bad input as a ValueError (the CLI) keeps working.
    """

    def __init__(self, message: str, field: Field = Field.NONE, code: ErrorCode = ErrorCode.INVALID_VALUE) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code
