#!/usr/bin/env python3
"""Recomputes contract/tests/vectors.json from its inputs, independently of the Rust code.

Standard library only (hmac, hashlib, json, ipaddress); nothing from the Rust side. Reads the
committed vectors.json, takes each case's inputs (kind, key, t, body; key, addr, request_id, t)
and recomputes every other value from docs/CONTRACT.md alone:

  abort body (§3)   compact JSON, fields in the contract's order: request_id, reason,
                    age_ms, tokens, then idle_ms, gone_ms, attempt when present
                    (renewal and envelope bodies are taken as given: any JSON)
  prefix (§3)       per kind: "kvguard-abort-v2\0", "kvguard-renewal-v2\0",
                    "kvguard-envelope-v2\0", "kvguard-stamp-v2\0"
  signature (§3)    x-kvguard-signature: t=<t>,v1=<hex HMAC(key, "<t>.<body>")>,
                    v2=<hex HMAC(key, prefix(kind) + "<t>.<body>")>
  stamp (§4)        x-kvguard-control: <ip>:<port>;t=<t>;v2=<hex
                    HMAC(key, "kvguard-stamp-v2\0" + "<ip>:<port>|<request_id>|<t>")>
  proof (§8)        x-kvguard-instance: <instance>.<vm>;c=<counter>;h=<host or ->;a=<listener
                    or ->;s=<hex HMAC(key, "kvguard-proof-v2\0" + everything before ";s=")>
  HMAC              HMAC-SHA256, lowercase hex
  key               surrounding ASCII whitespace trimmed, at least 16 bytes

usage: gen_vectors.py [--check] [FILE]
  (default)  print the regenerated vectors.json (same layout as the committed file)
  --check    exit 1 naming every field whose committed value differs from the recomputed one
FILE defaults to vectors.json beside this script.
"""

import hashlib
import hmac
import ipaddress
import json
import os
import sys

MIN_KEY_LEN = 16
MAX_ID_LEN = 128
ID_EXTRA = set(".:_-")
REASONS = {
    "downstream_reset", "upstream_reset", "timeout", "first_token_timeout", "stalled",
    "max_age", "operator", "gateway_lost", "local_reply",
}
U64 = 2**64 - 1
U32 = 2**32 - 1
# Body fields in the contract's order; the optional ones are left out when absent.
BODY_FIELDS = [("request_id", True), ("reason", True), ("age_ms", True), ("tokens", True),
               ("idle_ms", False), ("gone_ms", False), ("attempt", False)]


# The domain-separation prefix of each signed message kind.
PREFIX = {
    "abort": b"kvguard-abort-v2\0",
    "renewal": b"kvguard-renewal-v2\0",
    "envelope": b"kvguard-envelope-v2\0",
    "stamp": b"kvguard-stamp-v2\0",
}
SIGNED_KINDS = ("abort", "renewal", "envelope")


class BadInput(Exception):
    pass


def key_bytes(key):
    k = key.encode().strip(b" \t\n\r\x0c")
    if len(k) < MIN_KEY_LEN:
        raise BadInput(f"key is {len(k)} bytes, at least {MIN_KEY_LEN} are required")
    return k


def mac_hex(key, msg):
    return hmac.new(key_bytes(key), msg, hashlib.sha256).hexdigest()


def check_id(rid):
    if not isinstance(rid, str) or not 1 <= len(rid) <= MAX_ID_LEN or not all(
            c.isascii() and (c.isalnum() or c in ID_EXTRA) for c in rid):
        raise BadInput(f"request id {rid!r} is not 1-128 bytes of [A-Za-z0-9._:-]")
    return rid


def check_uint(name, v, top):
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
        raise BadInput(f"{name} {v!r} is not an integer in 0..={top}")
    return v


def canonical_body(body):
    """The body as the contract serialises it (what the filter sends)."""
    fields = json.loads(body)
    out = {}
    for name, required in BODY_FIELDS:
        if name not in fields:
            if required:
                raise BadInput(f"body lacks {name}")
            continue
        v = fields[name]
        if name == "request_id":
            v = check_id(v)
        elif name == "reason":
            if v not in REASONS:
                raise BadInput(f"unknown reason {v!r}")
        else:
            v = check_uint(name, v, U32 if name == "attempt" else U64)
        out[name] = v
    return json.dumps(out, separators=(",", ":"))


def canonical_addr(addr):
    """<ip>:<port> the way a socket address prints: IPv4 dotted, IPv6 bracketed RFC 5952."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise BadInput(f"addr {addr!r} is not <ip>:<port>")
    if host.startswith("[") and host.endswith("]"):
        ip = ipaddress.IPv6Address(host[1:-1])
        if ip.ipv4_mapped is not None or ip.packed[:12] == bytes(12):
            raise BadInput(f"addr {addr!r}: embedded-IPv4 forms are not supported here")
        return f"[{ip.compressed}]:{int(port)}"
    return f"{ipaddress.IPv4Address(host)}:{int(port)}"


def signature_case(c):
    kind = c["kind"]
    if kind not in SIGNED_KINDS:
        raise BadInput(f"kind {kind!r} is not one of {SIGNED_KINDS}")
    t = check_uint("t", c["t"], U64)
    if kind == "abort":
        body = canonical_body(c["body"])
    else:
        json.loads(c["body"])
        body = c["body"]
    msg = f"{t}.{body}".encode()
    v1 = mac_hex(c["key"], msg)
    v2 = mac_hex(c["key"], PREFIX[kind] + msg)
    header = f"t={t},v1={v1},v2={v2}"
    return {"kind": kind, "key": c["key"], "t": t, "body": body, "header": header}


def stamp_case(c):
    t = check_uint("t", c["t"], U64)
    addr = canonical_addr(c["addr"])
    rid = check_id(c["request_id"])
    v2 = mac_hex(c["key"], PREFIX["stamp"] + f"{addr}|{rid}|{t}".encode())
    header = f"{addr};t={t};v2={v2}"
    return {"key": c["key"], "addr": addr, "request_id": rid, "t": t, "header": header}


def proof_case(c):
    instance, host = c["instance"], c["host"]
    for name, v in (("instance", instance), ("host", host)):
        if v is not None and (len(v) != 32 or any(ch not in "0123456789abcdef" for ch in v)):
            raise BadInput(f"{name} {v!r} is not 32 lowercase hex digits")
    vm = check_uint("vm", c["vm"], 2**32 - 1)
    counter = check_uint("counter", c["counter"], U64)
    listener = c["listener"]
    signed = f"{instance}.{vm};c={counter};h={host or '-'};a={listener or '-'}"
    s = mac_hex(c["key"], b"kvguard-proof-v2\0" + signed.encode())
    return {"key": c["key"], "instance": instance, "vm": vm, "counter": counter, "host": host,
            "listener": listener, "header": f"{signed};s={s}"}


def regenerate(doc):
    return {
        "comment": doc["comment"],
        "signature": [signature_case(c) for c in doc["signature"]],
        "stamp": [stamp_case(c) for c in doc["stamp"]],
        "proof": [proof_case(c) for c in doc.get("proof", [])],
    }


def render(doc):
    """The committed file's layout: one case per block, inputs first, derived values after."""
    d = json.dumps

    def block(case, first, rest):
        head = ", ".join(f"{d(k)}: {d(case[k])}" for k in first)
        tail = "".join(f",\n     {d(k)}: {d(case[k])}" for k in rest)
        return f"    {{{head}{tail}}}"

    sig = ",\n".join(block(c, ["kind", "key", "t"], ["body", "header"])
                     for c in doc["signature"])
    stp = ",\n".join(block(c, ["key", "addr", "request_id", "t"], ["header"])
                     for c in doc["stamp"])
    prf = ",\n".join(block(c, ["key", "instance", "vm", "counter", "host", "listener"],
                           ["header"])
                     for c in doc["proof"])
    return (f'{{\n  "comment": {d(doc["comment"])},\n  "signature": [\n{sig}\n  ],\n'
            f'  "stamp": [\n{stp}\n  ],\n  "proof": [\n{prf}\n  ]\n}}\n')


def differences(committed, computed):
    out = []
    for section in ("signature", "stamp", "proof"):
        have, want = committed.get(section, []), computed[section]
        if len(have) != len(want):
            out.append(f"{section}: {len(have)} cases, expected {len(want)}")
        for i, (h, w) in enumerate(zip(have, want)):
            for k in sorted(set(h) | set(w)):
                if h.get(k) != w.get(k):
                    out.append(f"{section}[{i}].{k}: committed {h.get(k)!r}, computed {w.get(k)!r}")
    return out


def main(argv):
    args = [a for a in argv if a != "--check"]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    path = args[0] if args else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "vectors.json")
    try:
        with open(path, encoding="utf-8") as f:
            committed = json.load(f)
        computed = regenerate(committed)
    except (OSError, BadInput, KeyError, TypeError, ValueError) as e:
        print(f"{path}: {e!r}", file=sys.stderr)
        return 1
    if "--check" not in argv:
        sys.stdout.write(render(computed))
        return 0
    diffs = differences(committed, computed)
    for line in diffs:
        print(f"{path}: {line}", file=sys.stderr)
    if diffs:
        return 1
    n = len(computed["signature"]) + len(computed["stamp"]) + len(computed["proof"])
    print(f"{path}: {n} vectors agree with the independent computation")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
