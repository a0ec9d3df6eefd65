"""The transport's I/O shells (STYLE 2, 13): UDP sockets and threads around the sans-I/O cores of
``gradshare/transport/protocol/``. Only this folder (and ``testing/``) may touch a socket or a clock."""
