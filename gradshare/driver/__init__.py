"""What runs in the driver (client) process: `SharedTrainer` and its fit, the Spark pre-pass and session
helpers, the barrier job over an RDD or a DataFrame, the checkpoint service, MLflow tracking and plots.

The driver builds the job that the tasks run (gradshare/task/) and starts the relay; it never trains a
replica itself. Nothing is imported here: `import gradshare.driver.x` loads what x needs.
"""
