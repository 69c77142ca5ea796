"""A TCP relay that puts a round trip between its clients and one upstream server: every chunk it
reads is held for half the round trip, in each direction, then forwarded, in order. Each direction
has its own reader and sender, so a chunk's delay runs from when it was read, not from when the
chunk before it left: pipelined requests pay one round trip together, as across a real network.
Bandwidth is not limited.

The TCP handshake a real far server would cost happens here at once (client and relay share a
host), so by default it is charged to the connection's first bytes instead: nothing a client sends
leaves before one round trip after it connected, as if ``connect()`` had returned only then.

    python tests/_delay_relay.py --upstream HOST:PORT --listen HOST:PORT:RTT_MS [--listen ...] [--no-handshake]

Prints ``READY`` on stdout once every listener is bound. Run by ``_network.FarServer`` inside the
server's network namespace; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket

CHUNK = 256 * 1024


def _nodelay(writer: asyncio.StreamWriter) -> None:
    # Without it Nagle's algorithm holds small writes for the peer's delayed ACK (up to 40 ms),
    # an extra delay the relay does not mean to add.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, not_before: float) -> None:
    """Forward ``reader`` to ``writer``, each chunk ``delay_s`` after it was read (and not before
    ``not_before`` + ``delay_s``); EOF is forwarded the same way."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while True:
            try:
                data = await reader.read(CHUNK)
            except OSError:  # a reset: the same as an end, for the other side
                data = b""
            queue.put_nowait((max(loop.time(), not_before) + delay_s, data))
            if not data:
                return

    async def send() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await send()
    finally:
        reading.cancel()


async def _serve(
    client_reader: asyncio.StreamReader,
    client_writer: asyncio.StreamWriter,
    upstream: tuple[str, int],
    delay_s: float,
    handshake: bool,
) -> None:
    loop = asyncio.get_running_loop()
    accepted = loop.time()
    _nodelay(client_writer)
    try:
        server_reader, server_writer = await asyncio.open_connection(*upstream)
    except OSError:
        client_writer.close()
        return
    _nodelay(server_writer)
    # The handshake's round trip (two half-trips) before the client's first bytes may leave.
    first_send = accepted + 2 * delay_s if handshake else accepted
    pumps = [
        asyncio.ensure_future(_pump(client_reader, server_writer, delay_s, first_send)),
        asyncio.ensure_future(_pump(server_reader, client_writer, delay_s, accepted)),
    ]
    try:
        # One direction failing (a reset) ends the connection; a clean EOF waits for the other side.
        await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)  # retrieved: no "never retrieved" noise
        for writer in (client_writer, server_writer):
            writer.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _main(args: argparse.Namespace) -> None:
    upstream = _address(args.upstream)
    servers = []
    for spec in args.listen:
        host, port, rtt_ms = spec.rsplit(":", 2)
        delay_s = float(rtt_ms) / 2000

        async def handle(r, w, delay_s=delay_s):
            # Cancelled at shutdown: end quietly (asyncio's streams log a cancelled handler as an error).
            with contextlib.suppress(asyncio.CancelledError):
                await _serve(r, w, upstream, delay_s, not args.no_handshake)

        servers.append(await asyncio.start_server(handle, host, int(port), reuse_address=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("READY", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the server")
    parser.add_argument("--listen", action="append", required=True, help="HOST:PORT:RTT_MS, one per listener")
    parser.add_argument("--no-handshake", action="store_true", help="do not charge the TCP handshake's round trip")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
