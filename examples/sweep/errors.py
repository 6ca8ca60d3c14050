"""Exceptions shared by the sweep's modules (kept import-light: listing points must not load torch)."""


class PointError(Exception):
    """A point that cannot be measured as asked; the message says why, the sweep goes on."""


class PeerMissing(Exception):
    """A peer whose setup (examples/peers/setup_peers.sh) has not been run here."""
