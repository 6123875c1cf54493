"""A standalone c10d rendezvous store for torchrun: a ``torch.distributed.TCPStore`` server and nothing else.

torchrun's c10d rendezvous keeps its state in a TCPStore. By default the agent whose host name matches
``--rdzv-endpoint`` hosts that store inside its own process, so losing that node takes the store, and with it
every other node's agent, down. Run this on a host that training does not run on (the login node, the
scheduler's head node, a small VM), and start every agent with ``--rdzv-conf is_host=false``::

    python rdzv_store.py --host 0.0.0.0 --port 29400      # on the store's host
    torchrun ... --rdzv-backend c10d --rdzv-endpoint store-host:29400 --rdzv-conf is_host=false ...

The server listens on ``--host`` only (port 0: a free port). Once it accepts connections it prints
``rendezvous store ready HOST:PORT`` on stdout; it serves until SIGTERM or SIGINT and then exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import socket
import sys

import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=29400, help="port to listen on, 0 for a free one (default %(default)s)"
    )
    args = p.parse_args(argv)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the store's thread starts, so that it inherits it
    # TCPStore binds every interface when it opens the port itself; a socket of our own limits it to --host
    listener = socket.create_server((args.host, args.port), backlog=1024)
    host, port = listener.getsockname()[:2]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(),
                          timeout=datetime.timedelta(seconds=30))  # fmt: skip
    print(f"rendezvous store ready {host}:{port}", flush=True)
    signal.sigwait(stop)
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
