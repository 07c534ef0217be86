"""Tasks and data: what the harness needs of a task and the registry behind --task (protocol.py), the built-in
verifiable counting task (task.py), and HF mode's prompts from jsonl / parquet with a checkpoint's own tokenizer and a
math-answer reward (hf_data.py, hf_task.py) or --reward's function in its place (hf_reward.py).

May import: parallel/ (parallel/cli.read_json, the JSON reader whose errors name the file). Imported by the harness
(warm-ups, experiment) and by serving/draft_vocab's demo.
"""
