"""OpenAI-style errors: every failure the router returns is one of these.

Client mistakes are 4xx ``invalid_request_error``s naming the offending parameter; worker
failures are 502/503/504 whose message names the pool (and worker) that failed, so an operator
reading a client's error knows where to look.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An error with its HTTP status and OpenAI ``error`` object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        metric_label: str | None = None,
    ):
        super().__init__(message)
        # Why, for the router's own metrics (e.g. queue_full / queue_timeout); never sent to the client.
        self.metric_label = metric_label
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def pool_unavailable(pool: str, retry_after_s: float = 2.0) -> ApiError:
    return ApiError(
        503,
        f"No healthy worker in the {pool} pool; retry shortly.",
        type="service_unavailable_error",
        code="pool_unavailable",
        retry_after_s=retry_after_s,
    )


def worker_failed(pool: str, worker: str, detail: str) -> ApiError:
    return ApiError(502, f"{pool} pool worker {worker} failed: {detail}", type="api_error", code="worker_error")


def worker_timeout(pool: str, worker: str, what: str) -> ApiError:
    return ApiError(504, f"{pool} pool worker {worker} timed out {what}", type="api_error", code="worker_timeout")
