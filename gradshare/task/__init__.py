"""What runs inside a Spark task: the worker (one rank's training loop), its partition's rows in
memory or spilled, the Arrow batches of the DataFrame path, its checkpoint files and validation
shard, the user objects it unpickles, and its step profile.

A task imports nothing from gradshare/driver/: what the driver ships it is plain data (WorkerConfig)
and functions of this package. Nothing is imported here: `import gradshare.task.x` loads what x needs.
"""
