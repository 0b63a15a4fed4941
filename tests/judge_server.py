"""A small, real OpenAI-compatible judge server for the LLM-judge tests (FastAPI under uvicorn,
in a thread): it answers like a reasoning judge model would, can fail its first requests with a
chosen status, stall past the client's timeout, or answer 200 with a body that is not JSON."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse


def judge_reply(prompt: str) -> str:
    """What a judge model writes for our prompts, keyed on the next state it was shown."""
    nxt = prompt.split("## The next state", 1)[1].split("\n\n", 1)[0].lower()  # this section only
    negative = any(w in nxt for w in ("no,", "wrong", "traceback", "error"))
    if "[HINT_START]" in prompt:  # the hint prompt
        if negative:
            return ("The user states the language they wanted.\n[HINT_START]Translate into Spanish, the language "
                    "the user asked for, not French.[HINT_END]\n\\boxed{1}")
        return "The next state reveals nothing actionable about the turn. \\boxed{-1}"
    if negative:
        return "The user corrects the assistant: the turn was wrong and has to be redone.\n\n\\boxed{-1}"
    if "thanks" in nxt or "passed" in nxt:
        return "The user thanks the assistant, so the turn achieved its goal.\n\n\\boxed{1}"
    return "The next state changes the topic and says nothing about this turn. \\boxed{0}"


def judge_app(fail_first: int = 0, status: int = 500, stall_first: int = 0, stall_s: float = 0.0,
              headers: dict | None = None, garbage: bool = False) -> FastAPI:
    app = FastAPI()
    app.state.calls = 0
    app.state.auth = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.calls += 1
        app.state.auth.append(request.headers.get("authorization"))
        n = app.state.calls
        if n <= stall_first:
            await asyncio.sleep(stall_s)
        if n <= fail_first:
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=status,
                                headers=headers)
        if garbage:
            return PlainTextResponse("<html>proxy error</html>")
        text = judge_reply(body["messages"][-1]["content"])
        return {"id": f"chatcmpl-{n}", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 300, "completion_tokens": 40, "total_tokens": 340}}

    return app


@contextlib.contextmanager
def serving(app: FastAPI, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("judge server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
