"""The names the remote tier's keys start with, shared with the server's ACLs and status.

Here, apart from the tier's code, so that ``warmstart.server`` reads them without importing redis
clients, and the cache never imports the server package.
"""

from __future__ import annotations

KEY_PREFIX = "ws:"
"""Every key the store writes starts with this; the server's writer and reader users see nothing else."""

REGISTRY_KEY = KEY_PREFIX + "registry"
"""A hash: one field per namespace and signing key id that wrote to this server (``<namespace>/<key
id>``), holding the namespace's components as JSON. ``warmstart cache explain`` reads it to name
what differs between this machine and the entries the server holds, without scanning keys."""
