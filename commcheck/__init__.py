"""The NCCL deadlock checker: the communication a training step issues, per rank, as a trace generated from the
schedule's own plan or recorded under gloo (comm_trace.py), replayed on a model of NCCL's rules (nccl_check.py);
whole train.py runs recorded per draft family and layout, kept in traces/ and replayed (recorded.py).

May import: every root concept below train.py and the folders below it; nothing imports it but tests.
"""
