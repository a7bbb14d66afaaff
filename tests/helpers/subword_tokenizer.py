"""A real subword tokenizer for tests: a byte-level BPE trained (deterministically) on a small corpus of
JSON and English, with Gemma's special ids pad 0, eos 1, bos 2, unk 3 (structured-output tests)."""

import json

CORPUS = [
    json.dumps({"name": "Alice", "age": 31, "tags": ["admin", "user"], "address": {"city": "Paris", "zip": "75001"}}),
    json.dumps({"id": 7, "status": "active", "score": 0.75, "items": [{"sku": "A-12", "qty": 3}]}),
    json.dumps({"colour": "red", "size": "large", "valid": True, "count": 12, "note": None}),
    "The quick brown fox jumps over the lazy dog. Numbers 0123456789 and dates 2024-05-17.",
    "key value pairs, lists of strings, nested objects with braces and quotes: {} [] \"\" : ,",
]


def subword_tokenizer_json(path, vocab_size: int = 400):
    """Write the trained tokenizer.json to `path`; returns the vocabulary size it has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path))
    return tok.get_vocab_size(with_added_tokens=True)
