"""The transport's protocol, sans I/O (testable without sockets or clocks): no ``socket``, ``threading`` or ``time``
here.

The relay and peer state machines take bytes in and give datagrams and events out; the current time is
an argument (``now=``). Each side is a folder, ``relay/`` and ``peer/``: a core and the parts it composes,
and neither side imports the other. What both use lives here: the wire codecs, the AEAD channel, the
frozen events, the tunables and the shared bookkeeping (range sets, reassembly, history, the log cursor,
the lifecycle tables). The I/O shells are in ``gradshare/transport/sockets/``.
"""
