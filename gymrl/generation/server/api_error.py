"""The policy server's refusals in OpenAI's error shape, in a module of their own so that the
steps the app runs (`app`, `request_body`, `render_worker`) can raise them without importing the
app."""

from __future__ import annotations


class ApiError(Exception):
    """A refusal in OpenAI's error shape, raised by a step and answered by the app: a step says
    what is wrong and the status, the app alone writes the answer."""

    def __init__(self, status: int, message: str, *, error_type: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
