"""The token server's FastAPI application: routes and OpenAI-style error bodies.

Kept apart from :mod:`verl_trainer.serving.server` because FastAPI resolves the handlers' annotations at
run time (this module does not use postponed annotations).
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from verl_trainer.serving.protocol import ChatRequest, CompletionRequest, RequestError

__all__ = ["build_app"]


def build_app(server: Any) -> FastAPI:
    """The app of ``server`` (a :class:`~verl_trainer.serving.server.TokenServer`).

    A body that fails validation is a 400 naming the field (FastAPI's default is a 422 without OpenAI's
    error shape).
    """
    app = FastAPI(title="verl-trainer token server")
    header = "X-Trajectory-Id"

    @app.exception_handler(RequestError)
    async def _bad(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = (f"invalid request: {where or 'body'}: {first.get('msg', 'bad value')} "
                   f"(got {first.get('input')!r})")
        error = RequestError(400, message[:500], where or None)
        return JSONResponse(error.body(), status_code=400)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "verl-trainer"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> dict[str, Any]:
        return await server.admit(server.completion, body, request.headers.get(header))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> dict[str, Any]:
        return await server.admit(server.chat, body, request.headers.get(header))

    return app
