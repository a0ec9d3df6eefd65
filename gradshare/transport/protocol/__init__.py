"""The transport's protocol, sans I/O (testable without sockets or clocks): no ``socket``, ``threading`` or ``time`` here.

The relay and peer state machines take bytes in and give datagrams and events out; the current time is
an argument (``now=``). Their bookkeeping (range sets, reassembly, history, ranks, snapshots), the wire
codecs, the AEAD channel and the frozen events live beside them. The I/O shells are in
``gradshare/transport/sockets/``.
"""
