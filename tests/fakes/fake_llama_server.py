"""A stand-in for llama.cpp's llama-server in tests: the flags bench throughput starts it with, /health that says
503 while "loading", and streamed completions of exactly max_tokens tokens (FAKE_LLAMA_SHORT=1: one fewer, as a
server that stopped at EOS would). It refuses a request that is not greedy, EOS-ignoring and in token ids."""
import argparse
import asyncio
import json
import os

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

parser = argparse.ArgumentParser()
for flag in ("-m", "-t", "-tb", "-np", "-c", "--host", "--port"):
    parser.add_argument(flag)
parser.add_argument("-cb", action="store_true")
parser.add_argument("--no-webui", action="store_true")
parser.add_argument("--no-cache-prompt", action="store_true")
args = parser.parse_args()
with open(os.environ["FAKE_LLAMA_LOG"], "w") as f:
    json.dump(vars(args), f)

app, health_calls = FastAPI(), [0]


@app.get("/health")
async def health():
    health_calls[0] += 1
    return JSONResponse({"status": "ok" if health_calls[0] > 2 else "loading"},
                        status_code=200 if health_calls[0] > 2 else 503)


@app.get("/v1/models")
async def models():
    return {"data": [{"id": "fake"}]}


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    prompt = body["prompt"]
    if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)) or body.get("temperature") != 0 \
            or body.get("ignore_eos") is not True or not body.get("stream"):
        return JSONResponse({"error": {"message": f"not what bench throughput sends: {body}"}}, status_code=400)
    n = body["max_tokens"] - (1 if os.environ.get("FAKE_LLAMA_SHORT") else 0)

    async def events():
        for _ in range(n):
            await asyncio.sleep(0.001)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
        yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n, 'prompt_tokens': len(prompt)}})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


uvicorn.run(app, host=args.host, port=int(args.port), log_level="warning")
