"""One model replica: its flat parameters, where its update goes and the point its gradient is taken
at, its precision and device, its loss step. torch only: no pyspark and no sockets, so a replica is
built and tested in one process (the worker, gradshare/task/worker.py, drives one per rank).

Nothing is imported here: `import gradshare.replica.x` loads what x needs.
"""
