"""UDP transport: wire format, AEAD, sans-I/O relay/peer cores, relay server, peer client.

    from gradshare.transport import Relay, Peer, Update, new_job_key, param_hash

The folders show what may touch a socket: ``protocol/`` holds the sans-I/O cores and their
bookkeeping (bytes in, datagrams and events out, the time an argument), ``sockets/`` the threads and UDP
sockets around them, ``testing/`` the in-memory link and the lossy proxy for tests and benchmarks.
``relay_main.py`` is the ``gradshare relay`` command; it stays at this level because the CLI finds a
command's module without importing its parent packages (cli._available), and this package's import
loads NumPy.
"""

from gradshare.hashing import param_hash  # re-exported: the public name users import from here
from gradshare.transport.protocol.crypto import new_job_key
from gradshare.transport.protocol.events import Update, Welcome
from gradshare.transport.protocol.peer.core import PeerCore
from gradshare.transport.protocol.relay.core import RelayCore
from gradshare.transport.protocol.tuning import PeerTuning, RelayTuning
from gradshare.transport.protocol.wire import DEFAULT_DATAGRAM_SIZE
from gradshare.transport.sockets.peer import Peer
from gradshare.transport.sockets.relay import Relay

__all__ = [
    "DEFAULT_DATAGRAM_SIZE",
    "Peer",
    "PeerCore",
    "PeerTuning",
    "Relay",
    "RelayCore",
    "RelayTuning",
    "Update",
    "Welcome",
    "new_job_key",
    "param_hash",
]
