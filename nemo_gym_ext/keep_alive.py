"""How long idle HTTP connections live, on both ends of every connection this project opens or
serves.

A client that reuses a pooled connection at the moment the server closes it for idleness loses
that request (httpx raises ReadError or "Server disconnected"), and no client library retries a
POST by itself. The race needs a client that keeps idle connections as long as the server does,
and that is the default pairing: uvicorn closes a connection idle for 5 s, httpx keeps one 5 s.
On a loaded machine (a client starved of CPU, an agent waiting on a tool) connections sit idle
that long, and the load benchmark lost requests to it (benchmarks/README.md, "Policy server
under load"). So both ends are set apart:

- this project's servers keep an idle connection for `SERVER_KEEP_ALIVE_S`, longer than the pools
  of common clients keep one (httpx 5 s, aiohttp 15 s: Gym's agents), so they close it first;
- this project's clients drop an idle connection after `CLIENT_KEEPALIVE_EXPIRY_S`, before the
  servers it does not run (SGLang's and Gym's, uvicorn's 5 s) close it.
"""

from __future__ import annotations

SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEPALIVE_EXPIRY_S = 2.0
