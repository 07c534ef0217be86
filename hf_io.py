"""HF checkpoint directories <-> model.Transformer, importable from the root (serving/hf_io.py holds the code)."""
from serving.hf_io import from_pretrained, save_pretrained  # noqa: F401
