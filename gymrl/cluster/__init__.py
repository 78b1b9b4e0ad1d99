"""Where things run: the placement of every role on GPUs and CPUs, Ray's session, waiting on Ray
with a deadline (`ray_calls`), and Slurm.

May import: config, run.
"""
