"""Process-group plumbing: the ring of point-to-point exchanges that context parallelism uses (ring.py; ThreadRing
runs cp ranks as threads in one process), the DP x PP x CP grid built once with every communicator warmed in one
global order (grid.py), the cross-rank checks that turn a disagreeing batch into an error (consistency.py), and the
--help of every entry point, generated from docstrings and config field comments (cli.py).

May import: nothing of the project (torch and the standard library only). Everything else may import it.
"""
