"""Process-group plumbing: the ring of point-to-point exchanges that context parallelism uses (ring.py; ThreadRing
runs cp ranks as threads in one process), the DP x PP x CP grid built once with every communicator warmed in one
global order (grid.py), the pipeline's layer split, AFAB / 1F1B action orders and point-to-point plan as pure
functions (pp_schedule.py), the point-to-point waits bounded by --dist_timeout (waits.py), the cross-rank checks that
turn a disagreeing batch or a disagreeing refit into an error (consistency.py), the named sums of an update
reduced in one all-reduce (step_totals.py), the host copy a tensor of boundaries carries so that host-side loops read
it without a device sync (host_copy.py), and the --help of every entry point, generated from
docstrings and config field comments (cli.py: it sits in this lowest folder because every layer's demo uses it).

May import: nothing of the project (torch and the standard library only). Everything else may import it.
"""
