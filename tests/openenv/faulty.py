"""An OpenEnv server that misbehaves on purpose, for the tests of training against OpenEnv
(issue 47). It speaks the `/ws` protocol as openenv-core does until the fault the episode
was reset with (`{"type": "reset", "data": {"fault": MODE}}`) strikes at its first step:

    malformed  answers text that is not JSON
    huge       answers an observation of 100 MB
    silent     never answers
    error      answers OpenEnv's error message
    close      closes the connection
    die        the whole server process exits
    refuse     answers the reset itself with OpenEnv's error message
    (none)     behaves: a user turn, reward 0.5, done after the third step

    cd tests/openenv && python -m uvicorn faulty:app --host 127.0.0.1 --port 0

With FAULTY_SCHEMA=strict its action schema takes only `{"text": …}`, which the default
action mapping (`{"message": …}`) cannot write.
"""

import asyncio
import json
import os

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

app = FastAPI()
STRICT = os.environ.get("FAULTY_SCHEMA") == "strict"


@app.get("/health")
def health():
    return {"status": "healthy"}


@app.get("/metadata")
def metadata():
    return {"name": "faulty", "description": "misbehaves on purpose"}


@app.get("/schema")
def schema():
    field = "text" if STRICT else "message"
    action = {
        "type": "object",
        "properties": {field: {"type": "string"}},
        "required": [field],
        "additionalProperties": False,
    }
    return {"action": action, "observation": {"type": "object"}, "state": {"type": "object"}}


def observation(content, reward=None, done=False):
    return json.dumps({
        "type": "observation",
        "data": {
            "observation": {"messages": [{"role": "user", "content": content}]},
            "reward": reward,
            "done": done,
        },
    })


@app.websocket("/ws")
async def session(ws: WebSocket):
    await ws.accept()
    fault, steps = None, 0
    try:
        while True:
            message = json.loads(await ws.receive_text())
            kind = message.get("type")
            if kind == "reset":
                fault, steps = message.get("data", {}).get("fault"), 0
                if fault == "refuse":
                    await ws.send_text(json.dumps({
                        "type": "error",
                        "data": {"message": "no episode for you", "code": "EXECUTION_ERROR"},
                    }))
                    continue
                await ws.send_text(observation("Say something."))
            elif kind == "step":
                steps += 1
                if fault == "malformed":
                    await ws.send_text('{"type": "observation", "data": {oops')
                elif fault == "huge":
                    await ws.send_text(observation("x" * (100 * 1024 * 1024)))
                elif fault == "silent":
                    await asyncio.sleep(3600)
                elif fault == "error":
                    await ws.send_text(json.dumps({
                        "type": "error",
                        "data": {"message": "the environment broke", "code": "EXECUTION_ERROR"},
                    }))
                elif fault == "close":
                    await ws.close()
                    return
                elif fault == "die":
                    os._exit(3)
                else:
                    await ws.send_text(observation(f"Again ({steps}).", reward=0.5, done=steps >= 3))
            elif kind == "close":
                return
            else:
                await ws.send_text(json.dumps({
                    "type": "error",
                    "data": {"message": f"unknown type {kind}", "code": "UNKNOWN_TYPE"},
                }))
    except WebSocketDisconnect:
        return
