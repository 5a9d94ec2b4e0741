"""A local HTTP server that speaks the OpenAI completions format, streamed (SSE) and
not: **not vLLM**, no model. It answers at once with ``--chunks`` fixed chunks, so that
what is measured through it is the HTTP path alone (the front door's overhead and its
byte-for-byte pass-through). With ``--echo-priority`` each answer carries the request's
``priority`` in a ``metasched_priority`` field, so a test can see the stamp arrive.

    python benchmarks/openai_stub.py --port 18940 [--chunks 16] [--echo-priority]
"""

from __future__ import annotations

import argparse
import json

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def make_app(chunks: int, echo_priority: bool = False) -> Starlette:
    """The stub's application (``/v1/completions``, ``/v1/chat/completions``,
    ``/health``)."""

    async def answer(request: Request) -> Response:
        body = json.loads(await request.body())
        chat = request.url.path.endswith("/chat/completions")
        prompt = body.get("prompt")
        n_prompt = len(prompt) if isinstance(prompt, list) else 4
        head = {"id": "cmpl-stub", "created": 0, "model": body["model"]}
        if echo_priority:
            head["metasched_priority"] = body.get("priority")

        def choice(i: int) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
            return {"index": 0, "text": f"t{i} ", "finish_reason": None}

        usage = {"prompt_tokens": n_prompt, "completion_tokens": chunks,
                 "total_tokens": n_prompt + chunks}
        if not body.get("stream"):
            text = "".join(f"t{i} " for i in range(chunks))
            c = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                 else {"index": 0, "text": text})
            return JSONResponse({**head, "object": "completion", "choices": [
                {**c, "finish_reason": "length"}], "usage": usage})

        async def events():
            for i in range(chunks):
                yield f"data: {json.dumps({**head, 'choices': [choice(i)]})}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[Route("/v1/completions", answer, methods=["POST"]),
                             Route("/v1/chat/completions", answer, methods=["POST"]),
                             Route("/health", health)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--chunks", type=int, default=16, help="output chunks per answer")
    ap.add_argument("--echo-priority", action="store_true",
                    help="answer with the request's priority (metasched_priority)")
    args = ap.parse_args()
    uvicorn.run(make_app(args.chunks, args.echo_priority), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
