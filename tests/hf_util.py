"""Tiny HF artefacts built in the tests, nothing downloaded: a byte-level BPE tokenizer.json, a random Llama
checkpoint directory, prompts.jsonl files."""
import json

import torch

CORPUS = ["What is 12 + 30? Answer: 42", "Compute 7 * 8. The answer is 56.", "Half of 3 is 3/2 = 1.5",
          "So the total is \\boxed{1,250} dollars", "#### -17", "x = 5, y = 10"] * 4
PAD, BOS, EOS = 0, 1, 2


def write_tokenizer(path, tokenizer_config=None) -> int:
    """Byte-level BPE (any text encodes) with Llama's post-processor (prepends <s>); saved as tokenizer.json.
    Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}, "pad_token": "<pad>",
           "add_bos_token": True} if tokenizer_config is None else tokenizer_config
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tk.get_vocab_size(with_added_tokens=True)


def write_word_tokenizer(path, words) -> int:
    """A word-level tokenizer.json over <pad> <s> </s> <unk> + words (split on whitespace), <s> prepended: a random
    model over so few tokens writes numbers often, so a math-answer reward varies within a group."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    path.mkdir(parents=True, exist_ok=True)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "pad_token": "<pad>", "add_bos_token": True}))
    return len(vocab)


def write_tiny_llama(path, extra_vocab: int = 3, seed: int = 0, num_hidden_layers: int = 2, words=None):
    """A random LlamaForCausalLM (hidden 32) with the BPE tokenizer above (or the word-level one over `words`), saved
    as an HF checkpoint directory."""
    import transformers
    V = write_tokenizer(path) if words is None else write_word_tokenizer(path, words)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V + extra_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS,
        eos_token_id=EOS, pad_token_id=PAD))
    hf.save_pretrained(path)
    return path


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def write_tiny_qwen3(path, words, vocab_size: int = 151936, seed: int = 0):
    """A random Qwen3ForCausalLM (hidden 32, 2 layers, tied embeddings) at Qwen's vocabulary size with the word-level
    tokenizer over `words` (ids past the tokenizer's are sampled too and decode to nothing), saved as an HF checkpoint
    directory."""
    import transformers
    write_word_tokenizer(path, words)
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD))
    hf.save_pretrained(path)
    return path


def write_sum_task(root) -> tuple:
    """A tiny word-level Llama checkpoint and 9 addition prompts ("What is a + b ?", a, b in 0..2) under `root`:
    (checkpoint folder, prompts.jsonl path)."""
    model = write_tiny_llama(root / "llama", extra_vocab=0, words="What is + ? 0 1 2 3 4 5".split())
    rows = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(3) for b in range(3)]
    return str(model), write_jsonl(root / "prompts.jsonl", rows)
