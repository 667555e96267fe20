"""The admin API: a small FastAPI app on admin.sock (mode 0600, in a 0700 folder: the file system is the auth).

Refusals come back as {"error": message} with 409 (or 400 for bad arguments); the CLI prints the message.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from llmdeploy.control.controller import ApplyRequest, Controller
from llmdeploy.control.errors import ControlError

log = logging.getLogger("llmdeploy.admin")


class CanaryRequest(BaseModel):
    percent: float


class RollbackRequest(BaseModel):
    to_revision: int | None = None


def create_admin_app(controller: Controller, request_down: Callable[[], None]) -> FastAPI:
    app = FastAPI(title="llmdeploy admin", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ControlError)
    async def _refused(_: Request, exc: ControlError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(ValidationError)
    async def _invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return JSONResponse({"error": f"invalid request: {exc.errors(include_input=False)}"}, status_code=400)

    @app.exception_handler(Exception)
    async def _crashed(_: Request, exc: Exception) -> JSONResponse:
        log.exception("admin request failed")
        return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/ping")
    async def ping() -> dict:
        return {"name": controller.paths.name, "pid": os.getpid()}

    @app.get("/status")
    async def status() -> dict:
        return await controller.status()

    @app.post("/apply")
    async def apply(req: ApplyRequest) -> dict:
        return await controller.apply(req)

    @app.post("/canary")
    async def canary(req: CanaryRequest) -> dict:
        return await controller.canary(req.percent)

    @app.post("/promote")
    async def promote() -> dict:
        return await controller.promote()

    @app.post("/rollback")
    async def rollback(req: RollbackRequest) -> dict:
        return await controller.rollback(req.to_revision)

    @app.post("/down")
    async def down() -> dict:
        request_down()
        return {"result": "stopping", "pid": os.getpid()}

    return app
