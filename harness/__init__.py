"""The experiment harness around the paper's ideas: the typed config, its command line and its flags by topic for
--help (config.py, flag_groups.py), the mesh (mesh.py), what a run is made of (experiment.py), the warm-ups, their
cache keys and the control arms (warmup.py, cache_keys.py, offline_arm.py, watch.py), the step's phases (rollout.py,
update.py, eval_arms.py) and what a run shows (report.py, plots.py, logger.py).

May import: every root concept file except train.py, and the folders below it (parallel/, tasks/, modeling/,
decoding/, backends/, serving/). Imported by checkpoints/ and train.py.
"""
