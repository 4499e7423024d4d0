"""The one error type for a bad user-supplied setting or request field. It is a ValueError that
names the offending parameter, so a caller (the server's error `param`, a CLI) maps it without
parsing the message."""
from __future__ import annotations


class ParamError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
