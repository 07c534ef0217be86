"""Checkpoints and resumes: atomic, verified, weights-only files (checkpoint.py), what each rank saves and restores
(resume.py), and the policy that lets a run resume only itself and lose no earlier result (resume_policy.py).

May import: harness/ and everything below it. Imported by train.py.
"""
