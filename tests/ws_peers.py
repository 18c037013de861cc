"""Real WebSocket peers for tests/tests/e2e/waypoint.rs (issue 21 item 4), one process each.

  serve-h1 PORT            the `websockets` package's server (HTTP/1.1 upgrade), echo
  serve-h2 PORT            hypercorn (h2c with RFC 8441 extended CONNECT), echo
  client URL               the `websockets` client: text, binary and 1 MB echoes
  status URL               the `websockets` client: the HTTP status refusing the upgrade
  bulk URL N               the `websockets` client: N 1 MiB echoes, uncompressed, timed
  client-h2 HOST PORT PATH RFC 8441 by hand with the `h2` library (prior knowledge),
                           then the same echoes in hand-made frames

Each client prints one line starting with `ok` on success, else fails with a message.
"""

import asyncio
import os
import socket
import struct
import sys

MESSAGES = [("text", "hello through the waypoint"), ("binary", bytes(range(256)) * 4), ("binary", os.urandom(1_000_000))]


async def echo(ws):
    async for m in ws:
        await ws.send(m)


async def serve_h1(port):
    from websockets.asyncio.server import serve

    async with serve(echo, "0.0.0.0", port, max_size=None) as server:
        print(f"listening {port}", flush=True)
        await server.serve_forever()


async def asgi_echo(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] == "http":
        await receive()
        body = f"http {scope['http_version']}\n".encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        return
    if (await receive())["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    print(f"websocket over HTTP/{scope['http_version']}", flush=True)
    while True:
        m = await receive()
        if m["type"] == "websocket.disconnect":
            return
        if m.get("bytes") is not None:
            await send({"type": "websocket.send", "bytes": m["bytes"]})
        else:
            await send({"type": "websocket.send", "text": m["text"]})


async def serve_h2(port):
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"0.0.0.0:{port}"]
    config.websocket_max_message_size = 4 * 1024 * 1024
    # hypercorn 0.18 never ends an HTTP/2 WebSocket stream after the close handshake:
    # the connection's idle timeout ends it (and the stream), so keep that short.
    config.keep_alive_timeout = 1
    print(f"listening {port}", flush=True)
    await serve(asgi_echo, config)


async def client(url):
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=10) as ws:
        for kind, m in MESSAGES:
            await ws.send(m)
            got = await asyncio.wait_for(ws.recv(), 10)
            if got != m:
                sys.exit(f"{kind} echo differs: sent {len(m)}, got {len(got)}")
    print(f"ok {len(MESSAGES)} echoes", flush=True)


async def bulk(url, count):
    """`count` 1 MiB binary messages echoed one after the other; prints MiB/s each way."""
    import time

    from websockets.asyncio.client import connect

    m = os.urandom(1 << 20)
    async with connect(url, max_size=None, open_timeout=10, compression=None) as ws:
        start = time.monotonic()
        for _ in range(count):
            await ws.send(m)
            if len(await asyncio.wait_for(ws.recv(), 10)) != len(m):
                sys.exit("short echo")
        took = time.monotonic() - start
    print(f"ok {count} MiB each way in {took:.2f} s: {count / took:.0f} MiB/s", flush=True)


async def status(url):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        async with connect(url, open_timeout=10):
            sys.exit("the upgrade was accepted")
    except InvalidStatus as e:
        print(f"status {e.response.status_code}", flush=True)


def ws_frame(opcode, payload):
    """A masked client frame (RFC 6455 5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x80 | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    # XOR as big integers: fast enough for a 1 MB message in pure Python.
    full = (mask * (n // 4 + 1))[:n]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(full, "big")).to_bytes(n, "big")
    return head + mask + masked


def parse_frame(buf):
    """(fin, opcode, payload, rest) of one unmasked server frame, or None if incomplete."""
    if len(buf) < 2:
        return None
    fin, opcode, n, i = buf[0] & 0x80, buf[0] & 0x0F, buf[1] & 0x7F, 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, i = struct.unpack("!H", buf[2:4])[0], 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, i = struct.unpack("!Q", buf[2:10])[0], 10
    if len(buf) < i + n:
        return None
    return fin, opcode, buf[i : i + n], buf[i + n :]


def client_h2(host, port, path):
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    sock = socket.create_connection((host, int(port)), timeout=10)
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    sock.sendall(conn.data_to_send())
    enabled, sid, status, buf, stream_ended = False, None, None, b"", False

    def pump(eof_ok=False):
        nonlocal enabled, status, buf, stream_ended
        data = sock.recv(65536)
        if not data:
            if eof_ok:
                return False
            sys.exit("connection closed")
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.RemoteSettingsChanged):
                c = ev.changed_settings.get(h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL)
                enabled = enabled or bool(c and c.new_value == 1)
            elif isinstance(ev, h2.events.ResponseReceived):
                status = dict(ev.headers).get(":status")
            elif isinstance(ev, h2.events.DataReceived):
                buf += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, h2.events.StreamEnded):
                stream_ended = True
            elif isinstance(ev, h2.events.StreamReset):
                sys.exit(f"stream reset: {ev.error_code}")
        sock.sendall(conn.data_to_send())
        return True

    while not enabled:
        pump()
    sid = conn.get_next_available_stream_id()
    headers = [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "http"), (":path", path), (":authority", host), ("sec-websocket-version", "13")]
    conn.send_headers(sid, headers)
    sock.sendall(conn.data_to_send())
    while status is None:
        pump()
    if status != "200":
        print(f"status {status}", flush=True)
        return

    def send_all(data):
        while data:
            while conn.local_flow_control_window(sid) <= 0:
                pump()
            n = min(len(data), conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
            conn.send_data(sid, data[:n])
            sock.sendall(conn.data_to_send())
            data = data[n:]

    for kind, m in MESSAGES:
        opcode, payload = (1, m.encode()) if kind == "text" else (2, m)
        send_all(ws_frame(opcode, payload))
        got = b""
        while True:
            f = parse_frame(buf)
            if f is None:
                pump()
                continue
            fin, op, data, buf = f
            got += data
            if fin:
                break
        if op not in (0, opcode) or got != payload:
            sys.exit(f"{kind} echo differs: sent {len(payload)}, got {len(got)} (opcode {op})")
    # Close handshake: the server's close frame, then its END_STREAM (or, hypercorn,
    # the connection's end); then we end our side if the connection is still there.
    send_all(ws_frame(8, struct.pack("!H", 1000)))
    open_ = True
    while (f := parse_frame(buf)) is None and open_:
        open_ = pump(eof_ok=True)
    if f is None or f[1] != 8:
        sys.exit("no close frame from the server")
    while open_ and not stream_ended:
        open_ = pump(eof_ok=True)
    if open_:
        conn.end_stream(sid)
        sock.sendall(conn.data_to_send())
    print(f"ok {len(MESSAGES)} echoes over extended CONNECT", flush=True)


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "serve-h1":
        asyncio.run(serve_h1(int(args[0])))
    elif cmd == "serve-h2":
        asyncio.run(serve_h2(int(args[0])))
    elif cmd == "client":
        asyncio.run(client(args[0]))
    elif cmd == "bulk":
        asyncio.run(bulk(args[0], int(args[1])))
    elif cmd == "status":
        asyncio.run(status(args[0]))
    elif cmd == "client-h2":
        client_h2(*args)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
