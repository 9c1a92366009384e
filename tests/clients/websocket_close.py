# A stock WebSocket library (`pip install websockets`) leaving mid-stream, every way a client
# can, against a running `nsactor serve`; the server must hold no socket in CLOSE-WAIT after:
#   nsactor train --steps 2 --out /tmp/run
#   nsactor serve --checkpoint /tmp/run --addr 127.0.0.1:18080 &
#   python3 tests/clients/websocket_close.py [18080] [60]
# 60 connections each start a 200-token generation; after its first event a third close
# cleanly, a third reset the TCP connection, a third send FIN without a Close frame. Then
# `ss` counts the server port's CLOSE-WAIT sockets and a new connection must stream to `done`.
# CI checks the same leak with Rust clients (tests/tests/soak.rs); this exits 1 on a leak.
import asyncio, json, subprocess, sys
import websockets

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 18080
N = int(sys.argv[2]) if len(sys.argv) > 2 else 60
URI = f"ws://127.0.0.1:{PORT}/ws"


async def leave(i):
    ws = await websockets.connect(URI, max_size=None)
    await ws.send(json.dumps({"type": "generate", "id": f"r{i}", "prompt": "Once upon a time",
                              "max_tokens": 200}))
    first = json.loads(await ws.recv())
    if i % 3 == 0:
        await ws.close()
    elif i % 3 == 1:
        ws.transport.abort()
    else:
        ws.transport.close()
    return first.get("type")


def sockets(state):
    out = subprocess.run(["ss", "-tan", "state", state, f"( sport = :{PORT} )"],
                         capture_output=True, text=True, check=True).stdout
    return len([l for l in out.splitlines()[1:] if l.strip()])


async def main():
    firsts = await asyncio.gather(*[leave(i) for i in range(N)])
    assert set(firsts) == {"delta"}, f"first events {sorted(set(firsts))} (is the server warm?)"
    await asyncio.sleep(3)
    waiting = sockets("close-wait")
    print(f"{N} clients left mid-stream; 3 s later CLOSE-WAIT: {waiting}, "
          f"TIME-WAIT: {sockets('time-wait')}")
    async with websockets.connect(URI) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "after", "prompt": "Hello",
                                  "max_tokens": 8}))
        while (last := json.loads(await ws.recv()).get("type")) not in ("done", "error"):
            pass
    print("a new connection afterwards ended with:", last)
    sys.exit(0 if waiting == 0 and last == "done" else 1)


asyncio.run(main())
