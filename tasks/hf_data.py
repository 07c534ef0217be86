"""HF mode data as RL users bring it: prompt rows from jsonl or parquet, chat prompts rendered with the checkpoint's
chat template (what TRL, verl and OpenRLHF do).

A row holds a prompt and a reference answer under `prompt_key` / `answer_key` (a dotted key reaches into nested
fields: verl's GSM8K parquet keeps the answer in `reward_model.ground_truth`). The prompt is either

  * a string: fed to the tokenizer as is (tokenizer.json's post-processor adds BOS where the model wants it), or
  * a chat, [{"role": "user", "content": "..."}, ...]: rendered by the checkpoint's Jinja chat template with
    add_generation_prompt=True, the way transformers' apply_chat_template does (sandboxed Jinja, `tojson`,
    `raise_exception`, `strftime_now`, the special-token strings); the template writes every special token, so the
    rendered text is encoded without adding any.

The template is tokenizer_config.json's `chat_template` (its "default" entry when there are several), else the
checkpoint's chat_template.jinja; `--chat_template` overrides it with a file or an inline template, or `none` (a chat
prompt is then an error). jinja2 (an optional extra, also pulled in by transformers) is imported only when a chat
prompt has to be rendered; parquet needs pyarrow (or pandas with a parquet engine).

    python -m tasks.hf_data MODEL_DIR prompts.parquet [--prompt_key=...]   # prints the first rendered prompts
"""
from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str  # the text the tokenizer sees (a chat prompt already rendered)
    answer: str
    line: int  # 1-based line (jsonl) or row (parquet), for error messages and logs
    chat: bool = False  # rendered from messages: its special tokens are in the text, encode adds none


# ------------------------------------------------------------------------------------------------------ the rows
def read_rows(path: str) -> list:
    """[(line, row)] from a jsonl file (blank lines skipped; gzip-compressed too, whatever its name) or a .parquet
    file; anything malformed names the line, text that is not UTF-8 too."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data={path!r}: no such file (expected jsonl or parquet with a prompt and an answer "
                                "per row)")
    if path.endswith(".parquet"):
        return list(enumerate(_read_parquet(path), 1))
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"  # gzip's magic number
    rows = []
    with (gzip.open if gz else open)(path, "rb") as f:
        try:
            for n, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{n}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                     "expected UTF-8 jsonl (re-encode it, e.g. iconv -f latin1 -t utf-8)") from None
                if not line.strip():
                    continue
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno})") from None
        except (OSError, EOFError) as e:  # gzip.BadGzipFile, a truncated archive
            raise ValueError(f"{path}: unreadable gzip file ({type(e).__name__}: {e})") from None
    return rows


def _read_parquet(path: str) -> list:
    try:
        import pyarrow.parquet as pq
        return pq.read_table(path).to_pylist()
    except ImportError:
        pass
    try:
        import pandas as pd
        return [{k: _plain(v) for k, v in r.items()} for r in pd.read_parquet(path).to_dict("records")]
    except ImportError:
        raise ImportError(f"data={path!r}: reading parquet needs pyarrow: pip install -e \".[parquet]\"") from None


def _plain(v):  # numpy scalars / arrays (pandas rows) -> Python values
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def file_sha256(path: str) -> str | None:
    """sha256 of a file's bytes (None if there is no such file): a fingerprint of its contents, wherever it lies."""
    if not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _get(row: dict, key: str, where: str, flag: str):
    """row[key] when the row has a field of that very name (a literal "a.b"), else the dotted path a -> b."""
    if key in row:
        return row[key]
    v = row
    for i, part in enumerate(key.split(".")):
        if not isinstance(v, dict) or part not in v:
            fields = sorted(row) if isinstance(row, dict) else []
            inside = "" if i == 0 else f"; reaching in, {'.'.join(key.split('.')[:i])!r} has no field {part!r}"
            raise ValueError(f"{where}: missing field {key!r} (--{flag}; the row's fields: {fields}{inside})")
        v = v[part]
    return v


def load_examples(path: str, *, prompt_key: str = "prompt", answer_key: str = "answer", template=None) -> list:
    """Examples from `path`; chat prompts rendered with `template` (a ChatTemplate, or None: chat is an error)."""
    out = []
    for n, row in read_rows(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompt, answer = _get(row, prompt_key, where, "prompt_key"), _get(row, answer_key, where, "answer_key")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ValueError(f"{where}: {answer_key!r} must be a non-empty string or a number, got {answer!r:.60}")
        if isinstance(answer, float) and not math.isfinite(answer):
            raise ValueError(f"{where}: {answer_key!r} is {answer}: expected a finite number (no response can equal "
                             "it)")
        if isinstance(prompt, list):
            if template is None:
                raise ValueError(f"{where}: {prompt_key!r} is a chat (a list of messages) but there is no chat "
                                 "template (the checkpoint has none, or --chat_template=none)")
            out.append(Example(template.render(prompt, where), str(answer), n, chat=True))
        elif isinstance(prompt, str) and prompt.strip():
            out.append(Example(prompt, str(answer), n))
        else:
            raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string or a list of chat messages, got "
                             f"{prompt!r:.60}")
    if not out:
        raise ValueError(f"data={path!r}: the file holds no examples")
    return out


# ------------------------------------------------------------------------------------------------ chat templates
class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers' apply_chat_template(add_generation_prompt=True)."""

    def __init__(self, source: str, origin: str, special_tokens: dict):
        self.source, self.origin, self.special_tokens, self._t = source, origin, special_tokens, None

    @classmethod
    def for_checkpoint(cls, model_dir: str, spec: str = ""):
        """spec "": the checkpoint's own template (None if it has none); "none": None; else a file or a template."""
        cfg = _json(os.path.join(model_dir, "tokenizer_config.json"))
        tokens = {k: v["content"] if isinstance(v, dict) else v for k, v in cfg.items()
                  if k.endswith("_token") and isinstance(v, (str, dict))}
        if spec.strip().lower() == "none":
            return None
        if spec:
            if os.path.isfile(spec):
                with open(spec, encoding="utf-8") as f:
                    return cls(f.read(), spec, tokens)
            if "{{" in spec or "{%" in spec:
                return cls(spec, "--chat_template", tokens)
            raise ValueError(f"chat_template={spec!r}: neither a file nor a Jinja template (nor 'none')")
        src = cfg.get("chat_template")
        if isinstance(src, list):  # [{"name": ..., "template": ...}]: the default one
            src = {t.get("name"): t.get("template") for t in src}.get("default")
        origin = f"{model_dir}/tokenizer_config.json"
        jinja = os.path.join(model_dir, "chat_template.jinja")
        if not src and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                src, origin = f.read(), jinja
        return cls(src, origin, tokens) if src else None

    def render(self, messages, where: str) -> str:
        bad = [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str))]
        if not messages or bad:
            raise ValueError(f"{where}: a chat prompt is a non-empty list of {{'role': str, 'content': str}}; got "
                             f"{(bad or [messages])[0]!r:.80}")
        try:
            text = self._template().render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except ImportError:
            raise
        except Exception as e:  # jinja2.TemplateError, raise_exception(...), or an error inside the template's logic
            raise ValueError(f"{where}: the chat template ({self.origin}) cannot render this prompt: "
                             f"{type(e).__name__}: {e}") from None
        if not text.strip():
            raise ValueError(f"{where}: the chat template ({self.origin}) rendered an empty prompt")
        return text

    def _template(self):
        if self._t is None:
            try:
                import jinja2
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError:
                raise ImportError("chat prompts need jinja2 to render the chat template: pip install -e \".[chat]\"") \
                    from None

            def raise_exception(msg):
                raise jinja2.exceptions.TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: \
                json.dumps(x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
            env.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
            try:
                self._t = env.from_string(self.source)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template ({self.origin}): does not parse: {e}") from None
        return self._t


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:  # the parser's message names no file
        raise ValueError(f"{path}: invalid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


if __name__ == "__main__":
    from parallel.cli import parser
    ap = parser(__doc__, __file__)
    ap.add_argument("model_dir", help="an HF checkpoint directory (its chat template renders chat prompts)")
    ap.add_argument("data", help="a jsonl or parquet file, a prompt and an answer per row")
    ap.add_argument("--prompt_key", default="prompt", help="the row's prompt field (default: %(default)s)")
    ap.add_argument("--answer_key", default="answer", help="the row's answer field, dotted to reach in "
                                                           "(default: %(default)s)")
    ap.add_argument("--chat_template", default="", help="'' the checkpoint's, 'none', a file or a Jinja string")
    a = ap.parse_args()
    tpl = ChatTemplate.for_checkpoint(a.model_dir, a.chat_template)
    ex = load_examples(a.data, template=tpl, prompt_key=a.prompt_key, answer_key=a.answer_key)
    print(f"{len(ex)} examples; template: {tpl.origin if tpl else None}")
    for e in ex[:3]:
        print(f"--- line {e.line} (chat={e.chat}), answer {e.answer!r}\n{e.prompt}")
