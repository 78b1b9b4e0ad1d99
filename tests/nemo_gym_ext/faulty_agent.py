"""A Gym agent that misbehaves on purpose, run as its own process by the fault-matrix tests.

    python faulty_agent.py MODE PORT_FILE

Serves `POST /run` on 127.0.0.1 (a free port, written to PORT_FILE once it listens) and answers
every row according to MODE:

* `slow`: answers a valid-looking result after 60 s (the test kills the process before);
* `hang`: never answers;
* `malformed-json`: 200 with a body that is not JSON;
* `wrong-shape`: 200 with a JSON list instead of a result object;
* `missing-fields`: 200 with a JSON object that is not a Gym result;
* `huge`: 200 with a 100 MB JSON object (streamed, so the agent itself stays small);
* `busy`: 503 with `Retry-After: 1`, as an overloaded server answers;
* `straggle`: answers requests 2 to 4 with a valid one-turn Gym result (rewards 1, 2, 3) and
  never answers the others: of a group of four, one episode hangs on every attempt.
"""

import asyncio
import json
import socket
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

MB = 1024 * 1024


def make_app(mode: str) -> FastAPI:
    app = FastAPI()
    requests = 0

    @app.post("/run")
    async def run(request: Request):
        nonlocal requests
        requests += 1
        number = requests
        row = await request.json()
        if mode == "straggle":
            if not 2 <= number <= 4:
                await asyncio.Event().wait()
            return Response(json.dumps(_one_turn_result(row, float(number - 1))).encode())
        if mode == "slow":
            await asyncio.sleep(60)
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "malformed-json":
            return Response(b'{"output": [1, 2', media_type="application/json")
        if mode == "busy":
            return Response(b'{"detail": "busy"}', status_code=503, headers={"Retry-After": "1"})
        if mode == "wrong-shape":
            return Response(b"[1, 2, 3]", media_type="application/json")
        if mode == "huge":

            async def chunks():
                yield b'{"padding": "'
                for _ in range(100):
                    yield b"x" * MB
                yield b'"}'

            return StreamingResponse(chunks(), media_type="application/json")
        return Response(json.dumps({"id": row.get("id"), "not": "a result"}).encode())

    return app


def _one_turn_result(row: dict, reward: float) -> dict:
    turn = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "42"}],
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.1, -0.2],
    }
    return {**row, "reward": reward, "response": {"output": [turn]}}


def main() -> None:
    mode, port_file = sys.argv[1], sys.argv[2]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(mode), log_level="warning")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        with open(port_file, "w") as file:
            file.write(str(sock.getsockname()[1]))
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
