#!/usr/bin/env python3
"""OpenEnv's own client (openenv-core's GenericEnvClient, unchanged) against `rlhost env serve`.

    python drive.py GUESS_URL TOOLS_URL SMALL_URL

GUESS_URL serves the guess_number environment on samples whose secret is 42 (one sample);
TOOLS_URL the hostile plugin's tools (`count`: how many calls this session has had;
`misbehave`: faults on demand); SMALL_URL the same tools with --max-sessions 2. Every check
is an assert: a failure exits non-zero with the reason. Run by tests/integration/openenv.rs.
"""

import asyncio
import json
import sys
import urllib.request

from openenv import GenericEnvClient

GUESS, TOOLS, SMALL = sys.argv[1:4]


def error_code(e):
    """The code in GenericEnvClient's RuntimeError: 'Server error: … (code: X)'."""
    text = str(e)
    return text[text.rfind("(code: ") + 7:-1] if "(code: " in text else text


def guess_episode():
    with GenericEnvClient(base_url=GUESS, message_timeout_s=30).sync() as env:
        r = env.reset(seed=3)
        assert r.done is False and r.reward is None, r
        prompt = r.observation["messages"]
        assert prompt and prompt[0]["role"] == "user", r.observation
        assert r.observation["metadata"] == {"secret": 42}, r.observation
        r = env.step({"message": "I guess 50."})
        assert r.done is False, r
        assert r.observation["messages"][0]["role"] == "user", r.observation
        assert "lower" in r.observation["messages"][0]["content"].lower(), r.observation
        r = env.step({"message": "Then 42"})
        assert r.done is True and r.reward == 1.0, r
        state = env.state()
        assert state["step_count"] == 2 and state["done"] is True, state
        assert state["total_reward"] == 1.0, state
        for bad, code in [({"message": "7"}, "EXECUTION_ERROR"),  # after done
                          ({"bogus": 1}, "VALIDATION_ERROR"),
                          ({"message": 7}, "VALIDATION_ERROR")]:
            try:
                env.step(bad)
                raise AssertionError(f"{bad} was answered")
            except RuntimeError as e:
                assert error_code(e) == code, (bad, str(e))
        # The session survives its errors: a new episode on the same connection.
        r = env.reset(episode_id="second")
        assert env.state()["episode_id"] == "second"
        assert env.state()["step_count"] == 0
    print("guess_number: reset, steps, state, errors, a second episode: ok")


async def counting(i, calls):
    async with GenericEnvClient(base_url=TOOLS, message_timeout_s=30) as env:
        r = await env.reset(seed=i)
        names = sorted(t["name"] for t in r.observation["tools"])
        assert names == ["count", "misbehave"], names
        seen = []
        for _ in range(calls):
            r = await env.step({"name": "count", "arguments": {}})
            seen.append(r.observation["result"])
        return seen


async def faulting():
    async with GenericEnvClient(base_url=TOOLS, message_timeout_s=30) as env:
        await env.reset()
        await env.step({"name": "count", "arguments": {}})
        try:
            await env.step({"name": "misbehave", "arguments": {"mode": "panic"}})
            raise AssertionError("a panicking call was answered")
        except RuntimeError as e:
            assert error_code(e) == "EXECUTION_ERROR", str(e)
        try:
            await env.step({"name": "count", "arguments": {}})
            raise AssertionError("a step after the fault was answered")
        except RuntimeError as e:
            assert "reset" in str(e), str(e)
        r = await env.reset()
        r = await env.step({"name": "count", "arguments": {}})
        return r.observation["result"]


async def concurrent():
    results = await asyncio.gather(*(counting(i, 5) for i in range(8)), faulting())
    for seen in results[:-1]:
        # Each session's own count: no session sees another's calls.
        assert [int(s) for s in seen] == [1, 2, 3, 4, 5], seen
    print(f"tools: 8 sessions at once, each counting 1..5 alone; a fault ended one episode only "
          f"(after reset: {results[-1]})")


def capacity():
    first = GenericEnvClient(base_url=SMALL, message_timeout_s=30).sync()
    second = GenericEnvClient(base_url=SMALL, message_timeout_s=30).sync()
    first.connect()
    second.connect()
    first.reset()
    second.reset()
    third = GenericEnvClient(base_url=SMALL, message_timeout_s=30).sync()
    try:
        third.connect()
        third.reset()
        raise AssertionError("a third session was served by a server of two")
    except Exception as e:  # RuntimeError (CAPACITY_REACHED) or, in 0.3.0, the close first
        assert "CAPACITY_REACHED" in str(e) or "close" in type(e).__name__.lower() or "1000" in str(e), repr(e)
    first.close()
    # A slot freed: a new session is served.
    fourth = GenericEnvClient(base_url=SMALL, message_timeout_s=30).sync()
    fourth.connect()
    fourth.reset()
    fourth.close()
    second.close()
    print("capacity: the third of two sessions refused, a freed slot reused")


def http():
    def get(url):
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def post(url, body):
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    assert get(GUESS + "/health") == {"status": "healthy"}
    meta = get(GUESS + "/metadata")
    assert meta["name"] == "guess_number", meta
    schema = get(GUESS + "/schema")
    assert schema["action"]["required"] == ["message"], schema
    assert set(schema) == {"action", "observation", "state"}
    r = post(GUESS + "/reset", {"seed": 1})
    assert r["done"] is False and r["observation"]["metadata"] == {"secret": 42}, r
    r = post(GUESS + "/step", {"action": {"message": "42"}})
    assert r["done"] is True and r["reward"] == 1.0, r
    try:
        post(GUESS + "/step", {})
        raise AssertionError("a step without an action was answered")
    except urllib.error.HTTPError as e:
        assert e.code == 422, e.code
    tools = post(TOOLS + "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert sorted(t["name"] for t in tools["result"]["tools"]) == ["count", "misbehave"], tools
    call = post(TOOLS + "/mcp", {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                                 "params": {"name": "count", "arguments": {}}})
    assert call["result"]["isError"] is False, call
    none = post(GUESS + "/mcp", {"jsonrpc": "2.0", "id": 3, "method": "tools/list"})
    assert none["error"]["code"] == -32603, none
    stats = get(TOOLS + "/stats")
    # The faulting session's panic, counted; every session closed by now.
    assert stats["faults"] >= 1 and stats["steps"] >= 40 and stats["sessions"] == 0, stats
    print(f"http: health, metadata, schema, reset, step, 422, mcp tools/list and tools/call, stats {stats}: ok")


guess_episode()
asyncio.run(concurrent())
capacity()
http()
print("all OpenEnv checks passed")
