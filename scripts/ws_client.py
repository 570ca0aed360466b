#!/usr/bin/env python3
"""Stream one completion over shuttle's WebSocket and print the text as it arrives.

    .venv/bin/python scripts/ws_client.py "Once upon a time" --max-tokens 40 --url ws://127.0.0.1:8000/v1/ws
"""

import argparse
import asyncio
import json
import os
import sys

import aiohttp


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/ws")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY"),
                        help="sent as Authorization: Bearer (default: $SHUTTLE_API_KEY)")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return await stream(args, headers)
    except aiohttp.WSServerHandshakeError as exc:  # 401 (no or wrong key), 403 (Origin), 404 (wrong path)
        print(f"ws_client: {args.url} refused the WebSocket: HTTP {exc.status} {exc.message}", file=sys.stderr)
    except (aiohttp.ClientError, OSError) as exc:
        print(f"ws_client: cannot reach {args.url}: {exc}", file=sys.stderr)
    return 1


async def stream(args: argparse.Namespace, headers: dict[str, str]) -> int:
    """One generate on the socket, its text printed as it comes; 0 when it ended with `done`."""
    async with aiohttp.ClientSession(headers=headers) as session, session.ws_connect(args.url) as ws:
        await ws.send_json({"type": "generate", "id": "1", "prompt": args.prompt, "max_tokens": args.max_tokens,
                            "temperature": args.temperature})
        while True:
            msg = await ws.receive_json()
            if msg["type"] == "delta":
                print(msg["text"], end="", flush=True)
            else:
                print("\n" + json.dumps(msg))
                return 0 if msg["type"] == "done" else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
