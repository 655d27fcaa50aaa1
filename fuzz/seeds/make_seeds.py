#!/usr/bin/env python3
"""Writes the hand-made seeds of each fuzz target into fuzz/corpus/<target>/.

Run by scripts/fuzz before fuzzing (idempotent: files are named by content hash).
The input layouts are those read by fuzz/src/checks.rs (`Bytes`: a mode byte, length-
prefixed slices, the rest)."""
import hashlib, json, os, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
fixtures = os.environ.get("KVGUARD_FIXTURES", os.path.join(root, "..", "integration", "fixtures"))
corpus = os.path.join(root, "corpus")


def sl(b):
    """A length-prefixed slice as `Bytes::slice` reads it."""
    if len(b) < 255:
        return bytes([len(b)]) + b
    return bytes([255, len(b) & 0xFF, (len(b) >> 8) & 0xFF]) + b


def put(target, data):
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    name = "seed-" + hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def fixture(p):
    try:
        with open(os.path.join(fixtures, p), "rb") as f:
            return f.read()
    except OSError:
        return b""


chat = fixture("sse/vllm-0.32-chat-usage.sse")
comp = fixture("sse/vllm-0.32-completions.sse")
metrics = fixture("vllm-0.32-metrics.txt")

n2 = (b'data: {"choices":[{"index":0,"text":" a","finish_reason":null},{"index":1,"text":" b","finish_reason":null}]}\n\n'
      b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n'
      b'data: {"choices":[{"index":1,"text":"","finish_reason":"stop"}]}\n\n')
resp = (b'event: response.created\ndata: {"type":"response.created"}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed"}\n\n')
ndjson = b'{"model":"m","response":"a","done":false}\n{"model":"m","response":"b","done":true}\n'
keepalive = b': keep-alive\n\n: keep-alive\r\n\r\ndata: {"choices":[{"index":0,"delta":{"content":"x"}}]}\r\n\r\n'
odd = b'data:x\rdata: y\r\rid: 1\nretry: 5\nevent: e\ndata\n\ndata: [DONE]\n\n'
big = b"data: " + b"x" * 2000 + b"\n\n" + b"data: [DONE]\n\n"
multi = b'data: {"choices":\ndata: [{"index":0,"finish_reason":"stop"}]}\n\n'

bodies = [chat, comp, n2, resp, keepalive, odd, big, multi, b"data: [DONE]\n\n"]
for mode in (0, 4, 8, 12):
    for body in bodies:
        if body:
            put("sse_scanner", bytes([mode, 0]) + body)
            put("control_scanner", bytes([0, 0]) + body)
put("sse_scanner", bytes([1, 0]) + ndjson)
put("sse_scanner", bytes([2, 0]) + chat)
put("sse_scanner", bytes([0, 3, 10, 0, 11, 0, 200, 0]) + chat)
put("control_scanner", bytes([1, 0]) + ndjson)
put("control_scanner", bytes([0, 2, 5, 0, 7, 0]) + keepalive)

for body in bodies + [ndjson]:
    for line in body.splitlines():
        if line.startswith(b"data: {"):
            put("json_look", line[6:])
        elif line.startswith(b"{"):
            put("json_look", line)
for j in [b'{"choices":[{"index":3,"delta":{"tool_calls":[{"index":0}]},"finish_reason":"tool_calls"}]}',
          b'{"type":"response.failed","response":{"type":"response.completed"}}',
          b'{"done":"true","x":{"done":true}}', b'[1,2,3]', b'{"a":"\\u00e9\\"}"}']:
    put("json_look", j)

configs = [
    {"control_cluster": "kvguard_control", "secret_env": "KVGUARD_SECRET"},
    {"control_cluster": "kvguard_control", "secret": "0123456789abcdef0123", "mode": "observe",
     "idle_timeout_ms": 1000, "first_token_timeout_ms": 500, "max_age_ms": 60000, "tick_ms": 100,
     "paths": ["/v1/chat/completions", "/generate"],
     "routes": [{"path_prefix": "/v1/chat", "idle_timeout_ms": 5},
                {"path_prefix": "/v1/chat/completions/long", "max_age_ms": 0}],
     "abort_timeout_ms": 200, "abort_retries": 0, "max_pending_aborts": 1, "max_event_bytes": 1024},
    {"control_cluster": "c", "control_authority": "kvguard-control.ns:9902",
     "control_target_cluster": "kvguard_control_target", "control_target_cidrs": ["10.0.0.0/8", "fd00::/8", "127.0.0.1/32"],
     "abort_path": "/v1/abort", "secret_env": "SHORT"},
    {"control_cluster": "c", "secret": "x", "secret_env": "KVGUARD_SECRET"},
    {"control_cluster": "c", "secret_env": "KVGUARD_SECRET", "tick_ms": 0, "unknown": 1},
]
for c in configs:
    put("filter_config", json.dumps(c).encode())
put("filter_config", b"")
put("filter_config", b"{")

mac = b"ab" * 32
for value in [b"127.0.0.1:9902;t=1800000000;sig=" + mac, b"[fd00::1]:9902;t=1;sig=" + mac,
              b"10.1.2.3:80 ; t=0 ; sig=" + mac.upper(), b"host:1;t=1;sig=" + mac,
              b"t=1800000000,v1=" + mac, b"v1=" + mac + b", t=5, v2=zz",
              b"127.0.0.1:9902;t=1800000000;v2=" + mac, b"[fd00::1]:9902;t=1;v2=" + mac,
              b"t=1800000000,v1=" + mac + b",v2=" + mac, b"v2=" + mac + b", t=5, v3=zz"]:
    put("control_header", bytes([0]) + sl(b"req-1") + value)
    put("control_header", bytes([7]) + sl(b"chatcmpl-abc.def:ghi_jk-1") + value)

bodies = [b'{"request_id":"r1","reason":"stalled","age_ms":5,"tokens":6}',
          b'{"request_id":"r1","reason":"operator","future":[1,2]}',
          b'{"request_id":"a b","reason":"downstream_reset"}',
          b'{"request_id":"' + b"x" * 129 + b'","reason":"max_age"}',
          b'{"request_id":"r","reason":"bored"}', b'{"request_id":"r"}', b"{}", b"null",
          b'{"request_id":"r","reason":"timeout","age_ms":-1}',
          b'{"request_id":"r","reason":"timeout","age_ms":18446744073709551616}']
for body in bodies:
    put("abort_request", bytes([0]) + sl(b"t=1800000000,v1=" + mac) + body)
    put("abort_request", bytes([0]) + sl(b"t=1800000000,v2=" + mac) + body)
    put("abort_request", bytes([40]) + sl(b"") + body)
    put("control_abort_api", bytes([0]) + sl(b"") + sl(b"t=1800000000,v1=" + mac) + body)
    put("control_abort_api", bytes([0]) + sl(b"") + sl(b"t=1800000000,v2=" + mac) + body)
    put("control_abort_api", bytes([3]) + sl(b"x-other") + sl(b"v") + body)
    put("control_abort_api", bytes([0x80]) + sl(b"") + sl(b"") + body)

if metrics:
    put("control_text", metrics)
put("control_text", b"# keys\nkvguard-key-0123456789abcdef\n\nold-key-abcdefghijklmnop\n")
put("control_text", b'vllm:num_requests_running{engine="0",model_name="m"} 3 1700000000\nVmRSS:\t  1234 kB\n')


def eng(mode, ops):
    return bytes([mode]) + b"".join(ops)


def req(ctx, path=0, idm=0):
    return bytes([0, ctx, path, idm])


def hdrs(ctx, ct=0, enc=0):
    return bytes([1, ctx, ct, enc])


def body(ctx, data, eos=0):
    return bytes([2, ctx]) + sl(data) + bytes([eos])


def log(ctx, kind, flags=0):
    return bytes([3, ctx, kind, flags & 0xFF, flags >> 8, 0])


def tick(ctx, ms):
    return bytes([5, ctx, ms])


def answer(ctx, which, st):
    return bytes([6, ctx, which, st, 0])


ev = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
fin = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
for mode in (2, 3, 0x12, 0x24, 0x40):
    put("filter_engine", eng(mode, [req(0), hdrs(0), body(0, ev), body(0, fin, 1), log(0, 0)]))
    put("filter_engine", eng(mode, [req(1), hdrs(1), body(1, ev), log(1, 1), tick(1, 1), answer(1, 0, 0)]))
    put("filter_engine", eng(mode, [req(2), hdrs(2, 0, 8), body(2, ev), tick(2, 10), tick(2, 60), answer(2, 0, 4),
                                    tick(2, 100), answer(2, 0, 6), tick(2, 200), answer(2, 0, 1), log(2, 1)]))
    put("filter_engine", eng(mode, [req(3), req(4), req(5), req(6), req(7), req(8)] +
                         [log(c, 1) for c in range(3, 9)] + [tick(0, 5), answer(0, 0, 2)]))
    put("filter_engine", eng(mode, [req(1, 1, 2), req(2, 0, 2), hdrs(1, 2), body(1, b'{"done":false}\n{"done":true}\n'),
                                    log(1, 1), log(2, 2), bytes([8, 0]), tick(0, 5), bytes([8, 0]), tick(0, 5)]))
print("seeds written under", corpus)
