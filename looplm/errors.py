"""The one error type for a bad user-supplied setting or request field. It is a ValueError that
names the offending parameter, so a caller (the server's error `param`, a CLI) maps it without
parsing the message."""
from __future__ import annotations


class ParamError(ValueError):
    def __init__(self, param: str, message: str, code: str | None = None):
        """`code`: a machine-readable kind where an API names one (OpenAI's context_length_exceeded)."""
        super().__init__(message)
        self.param, self.code = param, code
