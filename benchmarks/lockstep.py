"""Lock-step N-worker training in one process (gradshare/bench/lockstep.py): one run, one JSON line.

    python benchmarks/lockstep.py '{"workload": "mlp", "world": 2, "epochs": 12, "schedule": "constant"}'
    python benchmarks/lockstep.py '{"workload": "tabular64k", "world": 64, "epochs": 8, "system": "local"}'
"""

from gradshare.bench.lockstep import main

if __name__ == "__main__":
    main()
