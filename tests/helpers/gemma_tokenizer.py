"""A small byte-level tokenizer.json whose special ids sit where Gemma 4's do (for chat-template tests)."""

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
MARKERS = {105: "<|turn>", 106: "<turn|>", 107: "<|think|>", 108: "<|channel>", 109: "<channel|>",
           110: "<|image|>", 111: "<|audio|>", 112: "<|video|>"}


def gemma_like_tokenizer_json(path, markers=None):
    """A byte-level tokenizer.json whose special ids sit where Gemma 4's do:
    pad 0, eos 1, bos 2, unk 3, mask 4, <|turn> 105, <turn|> 106 (then other markers, then bytes).
    `markers` ({id: piece}, default MARKERS) must hold consecutive ids from 105."""
    markers = MARKERS if markers is None else markers
    assert sorted(markers) == list(range(105, 105 + len(markers))), "marker ids must run from 105 without gaps"
    from tokenizers import AddedToken, Tokenizer as Tok, decoders, models, pre_tokenizers
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for i in range(105 - len(SPECIALS)):   # dense ids: <unused0> is 5, ..., <unused99> is 104
        vocab[f"<unused{i}>"] = len(vocab)
    vocab.update({piece: i for i, piece in sorted(markers.items())})
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # alphabet() order varies between processes
        vocab[ch] = len(vocab)
    tok = Tok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS + list(markers.values())])
    tok.save(str(path))
