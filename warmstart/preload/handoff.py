"""What a preloader hands the child it forks for a request, and how that child answers without
running the program: the request itself and the two markers of a child that declined. Shared by
``server.py``, which forks, and ``child.py``, which becomes the program.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

#: A child that could not become the program (its setup failed) ends with this status before
#: running any of it, after telling its process why.
CHILD_DECLINED = 213
#: What a child asked only whether it would run its process (``cache doctor``) writes where a child
#: that cannot run its process writes why: counted neither as served nor as refused.
DRY_RUN = b"\0dry run"


@dataclass
class Request:
    """A process's request to be run, as the forked child receives it: the connection to read the
    rest from (the process's command line, environment and descriptors), and where to write why, if
    the child cannot run it."""

    conn: socket.socket
    reason_fd: int
    preloader_socket: str
