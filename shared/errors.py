"""One error type for both sides, rendered in the OpenAI error shape.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; ``code``
is always a string so that the official ``openai`` client can surface it.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error that is safe to show the client as it is (no secrets, no scoped ids)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidField(APIError):
    """A 400 that names the offending request field (``param``)."""

    def __init__(self, param: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(400, code, message, param=param)


def error_body(message: str, type_: str, param: str | None, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
