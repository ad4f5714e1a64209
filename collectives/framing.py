"""Length-prefixed frames over a stream socket, sealed once both ends proved a shared secret.

The framing of the rendezvous store's connections, for other protocols to use the same way
(``remote`` does): :func:`send_frame`, :func:`recv_frame`, :func:`recv_exact` and
:class:`Seal`, whose tags make a frame that was altered, dropped, replayed, reordered or
reflected fail its check. The format is described in ``collectives._store._framing``, which
implements it (the store package needs nothing outside the standard library, so it lives
there).
"""

from __future__ import annotations

from ._store import _framing
from ._store._framing import *  # noqa: F403  # the names in its __all__

__all__: list[str] = []
__all__ += _framing.__all__
