"""End-to-end tests of `spark-run serve` with the official `openai` Python client.

The server runs the demo checkpoint (models/spark-demo-tiny, a 7M-parameter toy: it writes
English-like prose but cannot call tools). Tool calls are therefore tested through the server's
TEST HOOK `--scripted-reply FILE`: the server forces the scripted model output token by token
through the real scheduler, decoder and tool-call parser.

Binary: $SPARK_RUN (default target/release/spark-run). Run with tests/e2e/run.sh.
"""

import concurrent.futures
import datetime
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

from typing import Literal, Optional

import jsonschema
import openai
import pydantic
import pytest
import requests
from openai.lib._parsing._completions import type_to_response_format_param

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("SPARK_RUN", str(ROOT / "target" / "release" / "spark-run"))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "tap",
            "description": "Tap the item at an index on screen.",
            "parameters": {"type": "object", "properties": {"index": {"type": "integer"}}, "required": ["index"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
]

SCRIPT = "\n---\n".join(
    [
        # 1. strict Spark tool calls (two, back to back) after reasoning
        "The user wants the weather and a tap.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Hefei</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value></tool_call>",
        # 2. the answer after the tool results
        "I have the results.</think>It is sunny in Hefei.",
        # 3. the seen failure: bracketed, unterminated JSON
        'Tap it.</think>[tap]\n{"tool": "tap", "parameters": {"index": 1}',
        # 4. a call to a tool that was not offered: must not become a call
        "Hmm.</think><tool_call>rm_rf<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>",
    ]
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [BIN, "serve", "--port", str(self.port), "--ctx-size", "2048", "--max-body", "1MiB", *extra]
        self.log = open(ROOT / "target" / f"e2e-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.base + "/health", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not come up")
        self.model = requests.get(self.base + "/v1/models").json()["data"][0]["id"]
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self):
        text = requests.get(self.base + "/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(spark_\w+) ([0-9.eE+-]+)$", text, re.M)}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


def scripted_server(tmp_path, replies):
    """A server whose chat replies are `replies`, in turn (the --scripted-reply test hook)."""
    f = tmp_path / "script.txt"
    f.write_text("\n---\n".join(replies))
    return Server("--scripted-reply", str(f))


@pytest.fixture()
def scripted(tmp_path):
    f = tmp_path / "script.txt"
    f.write_text(SCRIPT)
    s = Server("--scripted-reply", str(f))
    yield s
    s.stop()


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["spark-demo-tiny"]
    assert requests.get(server.base + "/health").json()["status"] == "ok"


def test_plain_completion(server):
    r = server.client.completions.create(
        model=server.model, prompt="It is also possible to use a string or bytearray as a file for", max_tokens=16,
        temperature=0,
    )
    assert r.object == "text_completion"
    assert r.choices[0].text.strip()
    assert r.choices[0].finish_reason in ("length", "stop")
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Deterministic at temperature 0.
    again = server.client.completions.create(
        model=server.model, prompt="It is also possible to use a string or bytearray as a file for", max_tokens=16,
        temperature=0,
    )
    assert again.choices[0].text == r.choices[0].text


def test_completion_logprobs_and_stop(server):
    r = server.client.completions.create(
        model=server.model, prompt="The option", max_tokens=8, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    text = r.choices[0].text
    word = text.split()[1] if len(text.split()) > 1 else None
    if word:
        s = server.client.completions.create(model=server.model, prompt="The option", max_tokens=8, temperature=0,
                                             stop=[word])
        assert word not in s.choices[0].text
        assert s.choices[0].finish_reason == "stop"


def chat_args(server, thinking, **kw):
    return dict(
        model=server.model,
        messages=[{"role": "user", "content": "How do I set the output file?"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}, **kw.pop("extra_body", {})},
        **kw,
    )


def test_chat_thinking_off(server):
    r = server.client.chat.completions.create(**chat_args(server, False, max_tokens=24, temperature=0))
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    assert isinstance(msg.content, str)
    assert r.usage.completion_tokens <= 24


def test_chat_thinking_on_with_budget(server):
    r = server.client.chat.completions.create(
        **chat_args(server, True, max_tokens=40, temperature=0, extra_body={"max_thinking_tokens": 6, "ignore_eos": True})
    )
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning, "thinking on gives reasoning_content"
    # 6 reasoning tokens, then </think> forced, then content.
    assert msg.content
    assert r.usage.completion_tokens == 40


def test_streaming_matches_non_streaming(server):
    args = chat_args(server, False, max_tokens=24, temperature=0, seed=3)
    full = server.client.chat.completions.create(**args)
    stream = server.client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    content, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert content == (full.choices[0].message.content or "")
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_sixteen_concurrent_streams(server):
    def one(i):
        s = server.client.chat.completions.create(
            **chat_args(server, False, max_tokens=32, temperature=0.8, seed=i, extra_body={"ignore_eos": True}),
            stream=True,
        )
        n, finish = 0, None
        for chunk in s:
            for c in chunk.choices:
                n += 1
                finish = c.finish_reason or finish
        return n, finish

    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    assert all(f == "length" and n > 1 for n, f in results), results
    m = server.metrics()
    assert m["spark_kv_bytes_in_use"] == 0


def open_stream(server, max_tokens, chunks):
    """A streaming completion of `max_tokens` (ignore_eos) whose first `chunks` data lines have
    arrived: (response, the rest of its lines)."""
    body = {"model": server.model, "prompt": "The file", "max_tokens": max_tokens, "temperature": 0.7,
            "stream": True, "ignore_eos": True}
    r = requests.post(server.base + "/v1/completions", json=body, stream=True, timeout=60)
    assert r.status_code == 200
    lines = r.iter_lines()
    got = 0
    for line in lines:
        if line.startswith(b"data: "):
            got += 1
            if got == chunks:
                break
    return r, lines


def test_disconnect_mid_stream_frees_kv(server):
    r, _ = open_stream(server, 1500, 5)
    assert server.metrics()["spark_kv_bytes_in_use"] > 0
    r.close()
    deadline = time.time() + 15
    while time.time() < deadline:
        m = server.metrics()
        if m["spark_kv_bytes_in_use"] == 0 and m["spark_running_sequences"] == 0:
            break
        time.sleep(0.1)
    assert m["spark_kv_bytes_in_use"] == 0, m
    assert m["spark_requests_cancelled_total"] >= 1


def test_admission_control_queue_full_and_kv_budget():
    # One running sequence, one waiting; 1 MiB of KV: a 300-token request fits, a 2000-token one
    # does not (the demo model keeps about 1 KiB per token in its two full layers).
    s = Server("--max-seqs", "1", "--max-queue", "1", "--kv-budget", "1MiB")
    try:
        # The first request runs (its first chunks have arrived) ...
        _, first_lines = open_stream(s, 300, 3)
        body = {"model": s.model, "prompt": "The file", "max_tokens": 300, "ignore_eos": True}
        # ... the second waits in the queue ...
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(requests.post, s.base + "/v1/completions", json=body, timeout=120)
            deadline = time.time() + 15
            while s.metrics()["spark_queue_depth"] < 1 and time.time() < deadline:
                time.sleep(0.02)
            assert s.metrics()["spark_queue_depth"] == 1
            # ... so a third is refused with 429 and a Retry-After.
            r = post(s, "/v1/completions", body)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
            # A request that could never fit the KV budget: 400 (retrying cannot help), no
            # Retry-After.
            r = post(s, "/v1/completions", {**body, "max_tokens": 2000})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "kv_budget_exceeded"
            assert r.json()["error"]["param"] == "max_tokens"
            assert "Retry-After" not in r.headers
            # The admitted ones still complete, and nothing is left behind.
            rest = [line for line in first_lines if line.startswith(b"data: ")]
            assert rest[-1] == b"data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
            done = second.result()
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 300
        # Without max_tokens a request gets what the budget holds, not a refusal.
        r = post(s, "/v1/completions", {"model": s.model, "prompt": "The file", "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        held = r.json()["usage"]["total_tokens"]
        assert 300 < held < 2000, held
        m = s.metrics()
        assert m["spark_kv_bytes_in_use"] == 0 and m["spark_queue_depth"] == 0, m
        assert m["spark_requests_rejected_total"] >= 2, m
    finally:
        s.stop()


def post(server, path, body, raw=False):
    data = body if raw else json.dumps(body)
    return requests.post(server.base + path, data=data, headers={"Content-Type": "application/json"})


def test_errors(server):
    r = post(server, "/v1/chat/completions", b"{not json", raw=True)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    msgs = [{"role": "user", "content": "hi"}]
    r = post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": msgs})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature" and "hot" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "top_p": 7})
    assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "max_thinking_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_thinking_tokens"
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400
    # Tools are checked before anything runs; the error names the field.
    fn = {"name": "tap", "parameters": {"type": "object", "properties": {"index": {"type": "integer"}}}}
    for tool, param in [
        ({"type": "function", "function": {**fn, "name": "tap it"}}, "tools[0].function.name"),
        ({"type": "function", "function": {**fn, "name": "x" * 65}}, "tools[0].function.name"),
        ({"type": "function", "function": {**fn, "parameters": "none"}}, "tools[0].function.parameters"),
        ({"type": "function", "function": {**fn, "parameters": {"type": "array"}}}, "tools[0].function.parameters.type"),
        ({"type": "function", "function": {**fn, "parameters": {"type": "object", "properties": []}}},
         "tools[0].function.parameters.properties"),
        ({"type": "function", "function": {**fn, "parameters": {"type": "object", "required": "index"}}},
         "tools[0].function.parameters.required"),
        ({"type": "function", "function": {**fn, "description": 3}}, "tools[0].function.description"),
        ({"type": "retrieval", "function": fn}, "tools[0].type"),
        ({"type": "function"}, "tools[0].function"),
    ]:
        r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "tools": [tool]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (tool, r.text)
    tool = {"type": "function", "function": fn}
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "tools": [tool, tool]})
    assert r.status_code == 400 and "unique" in r.json()["error"]["message"], r.text
    # `developer` is OpenAI's newer name for `system`.
    r = post(server, "/v1/chat/completions", {"model": server.model, "max_tokens": 2, "messages": [
        {"role": "developer", "content": "Be brief."}, *msgs]})
    assert r.status_code == 200, r.text
    r2 = post(server, "/v1/chat/completions", {"model": server.model, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Be brief."}, *msgs]})
    assert r.json()["usage"]["prompt_tokens"] == r2.json()["usage"]["prompt_tokens"]
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "word " * 3000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(server, "/v1/completions", {"model": server.model, "prompt": [1, 2, 99999999]})
    assert r.status_code == 400
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "x" * (2 << 20)})
    assert r.status_code == 413
    r = requests.get(server.base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=server.model, messages=msgs, max_tokens=0)
    # Still serving.
    assert requests.get(server.base + "/health").ok


def test_tool_call_round_trip(scripted):
    c = scripted.client
    messages = [{"role": "user", "content": "Weather in Hefei for 3 days, then tap the first item."}]
    r = c.chat.completions.create(model=scripted.model, messages=messages, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.reasoning_content == "The user wants the weather and a tap."
    assert not msg.content
    calls = msg.tool_calls
    assert [t.function.name for t in calls] == ["get_weather", "tap"]
    assert json.loads(calls[0].function.arguments) == {"city": "Hefei", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"index": 1}
    assert calls[0].id != calls[1].id
    # Send the results back.
    messages.append(msg.model_dump(exclude_none=True))
    for t in calls:
        messages.append({"role": "tool", "tool_call_id": t.id, "content": json.dumps({"ok": True})})
    r2 = c.chat.completions.create(model=scripted.model, messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "It is sunny in Hefei."
    assert r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    # 3: the seen failure, recovered (streamed this time).
    stream = c.chat.completions.create(model=scripted.model, messages=messages[:1], tools=TOOLS, stream=True)
    calls, reasoning, content, finish = {}, "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                e = calls.setdefault(t.index, {"name": "", "arguments": ""})
                e["name"] += t.function.name or ""
                e["arguments"] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    assert reasoning == "Tap it."
    assert content == ""
    assert list(calls.values()) == [{"name": "tap", "arguments": json.dumps({"index": 1}, separators=(",", ":"))}]
    assert finish == "tool_calls"
    # 4: a tool that was not offered is never called.
    r4 = c.chat.completions.create(model=scripted.model, messages=messages[:1], tools=TOOLS)
    assert not r4.choices[0].message.tool_calls
    assert r4.choices[0].finish_reason == "stop"


def test_tool_choice_none_gives_no_calls(scripted):
    r = scripted.client.chat.completions.create(
        model=scripted.model, messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
    )
    assert not r.choices[0].message.tool_calls


def test_tool_choice_required_and_named_force_the_call(server):
    # The demo model never calls tools by itself; `tool_choice` makes the reply start a call:
    # `<tool_call>` (required) or `<tool_call>NAME` (named) is forced where the content begins,
    # right after `</think>` with thinking on, first with it off. What the model writes after
    # is its own, so the test checks the forced tokens (logprobs list every generated token).
    msgs = [{"role": "user", "content": "What is the weather in Hefei?"}]
    base = dict(model=server.model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=12, logprobs=True)

    def tokens(**kw):
        r = post(server, "/v1/chat/completions", {**base, **kw})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return [t["token"] for t in ch["logprobs"]["content"]], ch

    toks, ch = tokens(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      chat_template_kwargs={"enable_thinking": False})
    assert toks[0] == "<tool_call>" and "".join(toks[1:]).startswith("get_weather"), toks
    calls = ch["message"].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] in ([], ["get_weather"])
    if not calls:
        assert (ch["message"]["content"] or "").startswith("<tool_call>get_weather"), ch
    toks, _ = tokens(tool_choice="required", max_thinking_tokens=3)
    i = toks.index("</think>")
    assert i <= 3 and toks[i + 1] == "<tool_call>", toks
    toks, _ = tokens(tool_choice={"type": "function", "function": {"name": "tap"}}, max_thinking_tokens=2)
    i = toks.index("</think>")
    assert toks[i + 1] == "<tool_call>" and "".join(toks[i + 2:]).startswith("tap"), toks
    # Streaming forces the same tokens.
    r = requests.post(server.base + "/v1/chat/completions", json={
        **base, "stream": True, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "chat_template_kwargs": {"enable_thinking": False}}, stream=True, timeout=60)
    streamed = []
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            for c in json.loads(line[6:])["choices"]:
                streamed += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
    assert streamed[0] == "<tool_call>" and "".join(streamed[1:]).startswith("get_weather"), streamed
    # Bad choices are 400s naming `tool_choice`.
    for choice, tools in [({"type": "function", "function": {"name": "rm_rf"}}, TOOLS), ("required", None),
                          ("always", TOOLS), ({"type": "function"}, TOOLS), (3, TOOLS)]:
        body = {**base, "tool_choice": choice}
        if tools is None:
            body.pop("tools")
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", (choice, r.text)


SCHEMA_TOOLS = [
    {"type": "function", "function": {"name": "tap", "description": "Tap the item at an index on screen.",
                                      "parameters": {"type": "object", "properties": {"index": {"type": "integer"}},
                                                     "required": ["index"]}}},
    {"type": "function", "function": {"name": "set_mode", "description": "Switch the display mode.",
                                      "parameters": {"type": "object",
                                                     "properties": {"mode": {"enum": ["dark", "light"]},
                                                                    "on": {"type": "boolean"}},
                                                     "required": ["mode"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string", "maxLength": 12},
                                                                    "days": {"type": "integer"}},
                                                     "required": ["city"]}}},
]


def test_tool_calls_follow_the_tool_schemas(server):
    # The toy demo model cannot call tools: left alone it writes names and arguments that are
    # nonsense. Tool calls are held to the tools' schemas as they are generated, so with
    # tool_choice required every call it is made to write is a valid call: an offered name,
    # declared keys, values of the declared types (checked here by the jsonschema package), every
    # required argument, and nothing the parser had to recover.
    msgs = [{"role": "user", "content": "Turn on dark mode, then tap the first item."}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SCHEMA_TOOLS}
    names = set()
    for seed in range(5):
        for thinking in (False, True):
            body = {"model": server.model, "messages": msgs, "tools": SCHEMA_TOOLS, "tool_choice": "required",
                    "parallel_tool_calls": False, "temperature": 0.8, "seed": seed, "max_tokens": 120,
                    "max_thinking_tokens": 8, "chat_template_kwargs": {"enable_thinking": thinking}}
            r = post(server, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            assert ch["finish_reason"] == "tool_calls", ch
            assert "spark" not in r.json(), r.json()
            (call,) = ch["message"]["tool_calls"]
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            names.add(name)
    assert len(names) >= 2, names
    # A named choice: that tool, streamed.
    chunks = server.client.chat.completions.create(
        model=server.model, messages=msgs, tools=SCHEMA_TOOLS, stream=True, temperature=0.8, seed=1,
        tool_choice={"type": "function", "function": {"name": "set_mode"}}, parallel_tool_calls=False,
        max_tokens=60, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["set_mode"], calls
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas["set_mode"])
    # A keyword the grammar cannot enforce is relaxed, unless the tool is `strict`: then a 400.
    loose = {"type": "function", "function": {"name": "tap", "parameters": {
        "type": "object", "properties": {"index": {"type": "integer", "multipleOf": 1}}, "required": ["index"]}}}
    strict = json.loads(json.dumps(loose))
    strict["function"]["strict"] = True
    base = {"model": server.model, "messages": msgs, "max_tokens": 2}
    assert post(server, "/v1/chat/completions", {**base, "tools": [loose]}).status_code == 200
    r = post(server, "/v1/chat/completions", {**base, "tools": [strict]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters", r.text
    assert "$.properties.index.multipleOf" in r.json()["error"]["message"], r.text


def test_parallel_tool_calls_false_ends_with_the_first_call(tmp_path):
    two = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Hefei</arg_value></tool_call>"
           "<tool_call>tap<arg_key>index</arg_key><arg_value>1</arg_value></tool_call>")
    s = scripted_server(tmp_path, ["Two calls.</think>" + two] * 3)
    try:
        args = dict(model=s.model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
        r = s.client.chat.completions.create(**args)
        assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather", "tap"]
        r = s.client.chat.completions.create(parallel_tool_calls=False, **args)
        ch = r.choices[0]
        assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
        assert ch.finish_reason == "tool_calls"
        names = []
        for chunk in s.client.chat.completions.create(parallel_tool_calls=False, stream=True, **args):
            for c in chunk.choices:
                names += [t.function.name for t in c.delta.tool_calls or []]
        assert names == ["get_weather"]
        assert s.metrics()["spark_kv_bytes_in_use"] == 0
    finally:
        s.stop()


def test_logit_bias_and_unsupported_fields(server):
    base = {"model": server.model, "prompt": "The file", "max_tokens": 3, "temperature": 0, "logprobs": 1}

    def tokens(**kw):
        r = post(server, "/v1/completions", {**base, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]

    # +100 all but forces a token: every step picks it; two different ids give two different tokens.
    a, b = tokens(logit_bias={"300": 100}), tokens(logit_bias={"301": 100})
    assert len(set(a)) == 1 and len(set(b)) == 1 and a[0] != b[0], (a, b)
    # -100 bans one: with 300 banned, the next favourite (301) wins every step.
    assert tokens(logit_bias={"300": 50, "301": 40}) == a
    assert tokens(logit_bias={"300": -100, "301": 40}) == b
    for body, param in [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        r = post(server, "/v1/completions", {**base, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"multipleOf": 1}}}},
         "response_format"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ]:
        r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, "max_tokens": 2,
                                              "response_format": {"type": "text"}, "user": "u1"})
    assert r.status_code == 200, r.text


def test_json_mode_gives_json_objects(server):
    # response_format json_object: the content is one JSON object (the toy model's objects are
    # nonsense, but they parse), with thinking on (reasoning free, then the object) or off,
    # streamed or not.
    msgs = [{"role": "user", "content": "Describe a file as JSON with its name and size."}]
    complete = 0
    for seed in range(4):
        for thinking in (False, True):
            for stream in (False, True):
                body = {"model": server.model, "messages": msgs, "response_format": {"type": "json_object"},
                        "temperature": 0.8, "seed": seed, "max_tokens": 160, "max_thinking_tokens": 16,
                        "chat_template_kwargs": {"enable_thinking": thinking}}
                if stream:
                    r = requests.post(server.base + "/v1/chat/completions", json={**body, "stream": True}, stream=True)
                    content, finish = "", None
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            for c in json.loads(line[6:])["choices"]:
                                content += c["delta"].get("content") or ""
                                finish = c.get("finish_reason") or finish
                else:
                    r = post(server, "/v1/chat/completions", body)
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    content, finish = ch["message"]["content"], ch["finish_reason"]
                assert content.lstrip().startswith("{"), (seed, thinking, content)
                if finish == "stop":
                    assert isinstance(json.loads(content), dict), content
                    complete += 1
                else:
                    assert finish == "length", finish
    assert complete >= 8, complete
    for body in [{"response_format": {"type": "json_object"}, "tools": TOOLS},
                 {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "date"}}}},
                 {"response_format": {"type": "yaml"}}]:
        r = post(server, "/v1/chat/completions", {"model": server.model, "messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", (body, r.text)
    r = post(server, "/v1/completions", {"model": server.model, "prompt": "x", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


class Step(pydantic.BaseModel):
    action: Literal["tap", "type", "scroll", "done"]
    target: Optional[str] = pydantic.Field(max_length=24)
    index: int = pydantic.Field(ge=0, le=20)


class Plan(pydantic.BaseModel):
    goal: str = pydantic.Field(max_length=40)
    steps: list[Step] = pydantic.Field(max_length=3)
    confident: bool


class Ticket(pydantic.BaseModel):
    code: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{2}$")
    due: datetime.date
    score: float = pydantic.Field(gt=0, le=1)
    priority: int = pydantic.Field(ge=1, le=5)


def test_json_schema_output_follows_the_schema(server):
    # response_format json_schema: the content is one value of the schema. The schema here is the
    # one the openai client derives from a pydantic model (strict: $defs/$ref, anyOf with null,
    # enum, maxLength, maxItems, additionalProperties false; then number bounds, pattern and
    # format date). The toy model's values are nonsense, but every complete one must validate
    # (checked by the jsonschema package, not by spark).
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    msgs = [{"role": "user", "content": "Plan the taps to open the settings app."}]
    fmt = type_to_response_format_param(Plan)
    schema = fmt["json_schema"]["schema"]
    complete = 0
    for seed in range(3):
        for thinking in (False, True):
            for stream in (False, True):
                kw = dict(model=server.model, messages=msgs, response_format=fmt, temperature=0.8, seed=seed,
                          max_tokens=400, extra_body={"max_thinking_tokens": 16,
                                                      "chat_template_kwargs": {"enable_thinking": thinking}})
                if stream:
                    content, finish = "", None
                    for chunk in client.chat.completions.create(stream=True, **kw):
                        for c in chunk.choices:
                            content += c.delta.content or ""
                            finish = c.finish_reason or finish
                else:
                    ch = client.chat.completions.create(**kw).choices[0]
                    content, finish = ch.message.content, ch.finish_reason
                assert content.lstrip().startswith("{"), (seed, thinking, content)
                if finish == "stop":
                    jsonschema.validate(json.loads(content), schema)
                    complete += 1
                else:
                    assert finish == "length", finish
    assert complete >= 6, complete
    # The client's own parse() path: the reply comes back as a Plan.
    for seed in range(8):
        try:
            r = client.chat.completions.parse(model=server.model, messages=msgs, response_format=Plan,
                                              temperature=0.8, seed=seed, max_tokens=400,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(r.choices[0].message.parsed, Plan), r
        break
    else:
        pytest.fail("no seed gave a complete plan within 400 tokens")
    # Bounds, a pattern and a date format (validated with jsonschema's format checker).
    fmt = type_to_response_format_param(Ticket)
    schema = fmt["json_schema"]["schema"]
    complete = 0
    for seed in range(6):
        ch = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "File a ticket for the crash."}],
            response_format=fmt, temperature=0.8, seed=seed, max_tokens=300,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
        if ch.finish_reason == "stop":
            jsonschema.validate(json.loads(ch.message.content), schema, format_checker=jsonschema.FormatChecker())
            complete += 1
        else:
            assert ch.finish_reason == "length", ch
    assert complete >= 3, complete
    # A plain schema (no client involved): an enum-valued object with an integer list.
    schema = {"type": "object", "properties": {"mode": {"enum": ["dark", "light", None]},
                                               "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 4}},
              "required": ["mode", "ids"], "additionalProperties": False}
    r = post(server, "/v1/chat/completions", {
        "model": server.model, "messages": msgs, "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "prefs", "schema": schema}},
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    if ch["finish_reason"] == "stop":
        jsonschema.validate(json.loads(ch["message"]["content"]), schema)
    # Keywords spark does not enforce are refused, naming where they are.
    r = post(server, "/v1/chat/completions", {
        "model": server.model, "messages": msgs,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "$.properties.tags.uniqueItems" in r.json()["error"]["message"], r.text


def test_prefix_cache_reuses_earlier_turns_and_changes_nothing():
    # A conversation's second turn starts from the KV kept after the first turn's prompt (up to
    # its reply's role marker); greedy replies equal those of a server without the cache.
    cached, plain = Server(), Server("--prefix-cache", "0")
    try:
        replies = {}
        for name, s in (("cached", cached), ("plain", plain)):
            msgs = [{"role": "system", "content": "You answer about files."},
                    {"role": "user", "content": "What is a file handle?"}]
            out = []
            for turn in range(3):
                r = s.client.chat.completions.create(model=s.model, messages=msgs, temperature=0, max_tokens=24,
                                                     extra_body={"chat_template_kwargs": {"enable_thinking": turn != 1}})
                out.append(r.choices[0].message.content)
                msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": f"And question {turn}?"}]
            replies[name] = out
            m = s.metrics()
            if s is cached:
                assert m["spark_prefix_cache_hits_total"] >= 2, m
                assert m["spark_prefix_cache_tokens_total"] >= 60, m
                assert m["spark_prefix_cache_entries"] >= 2, m
            else:
                assert m["spark_prefix_cache_hits_total"] == 0, m
            assert m["spark_kv_bytes_in_use"] == 0, m
        assert replies["cached"] == replies["plain"]
    finally:
        cached.stop()
        plain.stop()


def test_stop_string_keeps_what_came_before_it(tmp_path):
    # A stop string inside a tool call: the call it cut short is still recovered (it was lost,
    # with its text, before session 30), streamed or not; the logprobs count every token.
    call = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Hefei</arg_value></tool_call>"
    s = scripted_server(tmp_path, ["Sure.</think>" + call] * 2 + ["Sure.</think>It is sunny in Hefei today. STOP more"])
    try:
        args = dict(model=s.model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
        r = s.client.chat.completions.create(stop=["</arg_value>"], logprobs=True, **args)
        ch = r.choices[0]
        assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
        assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Hefei"}
        assert ch.finish_reason == "tool_calls"
        assert len(ch.logprobs.content) == r.usage.completion_tokens
        calls = []
        for chunk in s.client.chat.completions.create(stop=["</arg_value>"], stream=True, **args):
            for c in chunk.choices:
                calls += [t.function.name for t in c.delta.tool_calls or []]
        assert calls == ["get_weather"]
        r = s.client.chat.completions.create(stop=["STOP"], **args)
        assert r.choices[0].message.content.startswith("It is sunny in Hefei today.")
        assert "STOP" not in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    finally:
        s.stop()


def test_a_call_cut_off_by_max_tokens_is_not_a_call(tmp_path):
    # The token limit ends the output inside a tool call: no call with made-up or missing
    # arguments is returned; its text is the content, finish_reason "length", and the
    # recovery notes say why. Streamed the same.
    call = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Hefei</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    s = scripted_server(tmp_path, ["Sure.</think>" + call] * 3)
    try:
        args = dict(model=s.model, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
        full = s.client.chat.completions.create(**args)
        assert full.choices[0].finish_reason == "tool_calls"
        n = full.usage.completion_tokens
        r = post(s, "/v1/chat/completions", dict(args, max_tokens=n - 4))
        body = r.json()
        ch = body["choices"][0]
        assert ch["finish_reason"] == "length"
        assert not ch["message"].get("tool_calls")
        assert ch["message"]["content"].startswith("<tool_call>get_weather<arg_key>city</arg_key>")
        assert any("cut off by the token limit" in n for n in body["spark"]["tool_call_recoveries"])
        calls, content, finish = [], "", None
        for chunk in s.client.chat.completions.create(stream=True, max_tokens=n - 4, **args):
            for c in chunk.choices:
                calls += c.delta.tool_calls or []
                content += c.delta.content or ""
                finish = c.finish_reason or finish
        assert calls == [] and finish == "length"
        assert content == ch["message"]["content"]
    finally:
        s.stop()


def test_stalled_clients_are_cut_off():
    # Headers that never end and a body that stops arriving: the connection is closed after
    # --read-timeout (the body with a 400 naming the timeout), and with --max-connections
    # taken by such clients a normal request is served once their time is up.
    s = Server("--read-timeout", "1", "--max-connections", "4")
    try:
        stalled = []
        for _ in range(6):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            stalled.append(c)
        t0 = time.time()
        r = s.client.chat.completions.create(
            model=s.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.choices[0].finish_reason in ("length", "stop")
        assert time.time() - t0 < 30
        for c in stalled:
            c.settimeout(10)
            try:
                data = c.recv(1024)
            except socket.timeout:
                pytest.fail("a connection with unfinished headers was left open")
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data
            c.close()
        c = socket.create_connection(("127.0.0.1", s.port))
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        c.settimeout(10)
        reply = c.recv(4096).decode(errors="replace")
        c.close()
        assert reply.startswith("HTTP/1.1 400"), reply
        assert "timeout" in reply, reply
    finally:
        s.stop()


def test_wrong_method_gets_a_json_error(server):
    for method, path in [("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("DELETE", "/health")]:
        r = requests.request(method, server.base + path, timeout=10)
        assert r.status_code == 405, (method, path)
        e = r.json()["error"]
        assert e["code"] == "method_not_allowed" and method in e["message"] and path in e["message"], e
