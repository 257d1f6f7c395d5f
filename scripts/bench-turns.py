#!/usr/bin/env python3
"""bench-turns.py -- time to the first token of each turn of an agent-style conversation on an
OpenAI-compatible server: a system prompt with tool definitions, then user turns that each add
the assistant's previous reply, as agents resend their whole history. Shows what the prefix
cache saves (compare `spark-run serve --prefix-cache 0` with the default).

Each rep is a fresh conversation (a different first user message, so turn 1 shares only the
system block with earlier reps). Reports, per turn, the prompt tokens and the median time to
the first streamed token over the reps.

    python3 scripts/bench-turns.py --url http://127.0.0.1:8080 [--turns 4] [--reps 3]

Needs `openai` (tests/e2e/run.sh makes a venv with it: target/e2e-venv).
"""
import argparse
import statistics
import time

from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}}
    for name, desc, props in [
        ("tap", "Tap the on-screen element with the given index.", {"index": {"type": "integer"}}),
        ("swipe", "Swipe from one point to another, in screen pixels.",
         {"x0": {"type": "integer"}, "y0": {"type": "integer"}, "x1": {"type": "integer"}, "y1": {"type": "integer"}}),
        ("type_text", "Type text into the focused field.", {"text": {"type": "string"}}),
        ("open_app", "Open an installed application by its package name.", {"package": {"type": "string"}}),
        ("read_screen", "Return the accessibility tree of the current screen.", {"depth": {"type": "integer"}}),
        ("go_back", "Press the system back button.", {"times": {"type": "integer"}}),
        ("search_web", "Search the web and return the top results.", {"query": {"type": "string"}, "n": {"type": "integer"}}),
        ("get_weather", "Weather forecast for a city.", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    ]
]
SYSTEM = ("You are an assistant that operates an Android phone for the user. Think about what is on "
          "the screen, then call exactly one tool per step. Prefer reading the screen before tapping. "
          "Never type passwords. When the task is done, answer in one short sentence.")
SCREEN = ("Screen: [0] Settings  [1] Wi-Fi  [2] Bluetooth  [3] Battery  [4] Display  [5] Sound  "
          "[6] Apps  [7] Storage  [8] Security  [9] Accounts  [10] System updates  [11] About phone")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default=None)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    client = OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = a.model or client.models.list().data[0].id
    ttft = [[] for _ in range(a.turns)]
    prompt_tokens = [0] * a.turns
    for rep in range(a.reps):
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {rep}: turn on Bluetooth, then check the battery. {SCREEN}"}]
        for t in range(a.turns):
            t0 = time.perf_counter()
            first, text, usage = None, "", None
            for chunk in client.chat.completions.create(
                    model=model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=a.max_tokens, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage:
                    usage = chunk.usage
                for c in chunk.choices:
                    d = c.delta
                    if first is None and (d.content or getattr(d, "reasoning_content", None) or d.tool_calls):
                        first = time.perf_counter() - t0
                    text += d.content or ""
            ttft[t].append(first if first is not None else time.perf_counter() - t0)
            prompt_tokens[t] = usage.prompt_tokens if usage else 0
            msgs += [{"role": "assistant", "content": text or "ok"},
                     {"role": "user", "content": f"Step {t} done. {SCREEN}"}]
    print(f"model {model}, {a.reps} conversations of {a.turns} turns, max_tokens {a.max_tokens}")
    print("turn  prompt_tokens  ttft_median_s  ttft_runs_s")
    for t in range(a.turns):
        runs = ", ".join(f"{x:.2f}" for x in ttft[t])
        print(f"{t + 1:>4}  {prompt_tokens[t]:>13}  {statistics.median(ttft[t]):>13.2f}  {runs}")


if __name__ == "__main__":
    main()
