"""The transport's I/O shells (thin: they move bytes and arm timers): UDP sockets and threads around the sans-I/O cores
of ``gradshare/transport/protocol/``. Only this folder (and ``testing/``) may touch a socket or a clock."""
