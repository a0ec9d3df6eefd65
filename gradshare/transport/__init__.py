"""UDP transport: wire format, AEAD, sans-I/O relay/peer cores, relay server, peer client.

    from gradshare.transport import Relay, Peer, Update, new_job_key, param_hash
"""

from gradshare.hashing import param_hash  # re-exported: the public name users import from here
from gradshare.transport.crypto import new_job_key
from gradshare.transport.events import Update, Welcome
from gradshare.transport.peer import Peer
from gradshare.transport.peer_core import PeerCore
from gradshare.transport.relay import Relay
from gradshare.transport.relay_core import RelayCore
from gradshare.transport.wire import DEFAULT_DATAGRAM_SIZE

__all__ = [
    "DEFAULT_DATAGRAM_SIZE",
    "Peer",
    "PeerCore",
    "Relay",
    "RelayCore",
    "Update",
    "Welcome",
    "new_job_key",
    "param_hash",
]
