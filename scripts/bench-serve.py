#!/usr/bin/env python3
"""bench-serve.py -- total generated tokens/s of an OpenAI-compatible server at several
concurrency levels (issue 5's serving benchmark), for spark-run serve and llama.cpp's
llama-server alike.

Each level sends N concurrent streaming /v1/completions requests, each with the same ~128-token
prompt (a fixed text; the exact token count is reported from `usage`) and max_tokens=128 with
ignore_eos, and reports sum(completion_tokens) / wall time.

    python3 scripts/bench-serve.py --url http://127.0.0.1:8080 --levels 1,2,4,8,16,32 [--model NAME]

Needs the `openai` package (tests/e2e/run.sh makes a venv with it: target/e2e-venv).
"""
import argparse
import asyncio
import json
import time

from openai import AsyncOpenAI

PROMPT = (
    "The following section describes the command line options of the program, the files it reads at "
    "start-up, the environment variables that change its behaviour, and the exit status it returns. "
    "Options that take an argument accept it either as the next word or after an equals sign. When "
    "the same option is given more than once, the last one wins, except where noted below. The "
    "configuration file is read before the command line is parsed, so options always override it. "
    "Lines that begin with a hash sign are comments and are ignored, and so are empty lines. Each "
    "remaining line holds one option name, an equals sign, and its value."
)


async def one(client, model, max_tokens):
    stream = await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    usage = None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
    return usage


async def level(client, model, n, max_tokens):
    t = time.perf_counter()
    usages = await asyncio.gather(*[one(client, model, max_tokens) for _ in range(n)])
    dt = time.perf_counter() - t
    gen = sum(u.completion_tokens for u in usages if u)
    prompt = usages[0].prompt_tokens if usages and usages[0] else None
    return {"streams": n, "generated": gen, "seconds": dt, "tok_s": gen / dt, "prompt_tokens": prompt}


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    client = AsyncOpenAI(base_url=a.url + "/v1", api_key="none", timeout=3600)
    if not a.model:
        a.model = (await client.models.list()).data[0].id
    for n in [int(x) for x in a.levels.split(",")]:
        print(json.dumps(await level(client, a.model, n, a.max_tokens)), flush=True)


asyncio.run(main())
