"""``python -m zerobench.worker``: the per-rank entry point under torchrun and ``zerobench run``.

The rank's code lives in :mod:`zerobench.rank.passes`; this name stays so that torchrun
and Slurm scripts written against it keep working (README, "Beyond one machine").
"""

from zerobench.rank.passes import main

if __name__ == "__main__":
    main()
