"""Lock-step N-worker training in one process: one run, one JSON line. A spec with "lm" runs a language
model (lab/lockstep_lm.py), any other a classification workload (lab/lockstep.py).

    python benchmarks/lockstep.py '{"workload": "mlp", "world": 2, "epochs": 12, "schedule": "constant"}'
    python benchmarks/lockstep.py '{"workload": "tabular64k", "world": 64, "epochs": 8, "system": "local"}'
    python benchmarks/lockstep.py '{"lm": "llama", "world": 4}'
"""

import json
import sys

from lab import lockstep, lockstep_lm

if __name__ == "__main__":
    lm = len(sys.argv) > 1 and "lm" in json.loads(sys.argv[1])
    lockstep.main(lockstep_lm.run if lm else lockstep.run)
