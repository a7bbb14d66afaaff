"""Tokenizer loading, encode/decode round trips and special ids, on tokenizers made here (no downloads)."""

import io
import json
import random

import numpy as np
import pytest

spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")

from dgemma_jax.io.tokenizer import (  # noqa: E402
    HFTokenizer, SentencePieceTokenizer, Tokenizer, find_tokenizer_file, load_tokenizer, read_special_ids)

MARKERS = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>"]
WORDS = ["hello", "world", "gemma", "diffusion", "canvas", "token", "the", "a", "of", "and", "naïve", "café",
         "Straße", "日本語", "テスト", "한국어", "😀", "🚀", "π", "x=1+2", "\t", "  ", "\n", "user", "model", "thought"]

TEXTS = [
    "",
    "hello world",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand  double  spaces",
    "naïve café Straße — “quotes” ‘and’ dashes…",
    "日本語のテスト、한국어 텍스트, 中文",
    "emoji 😀🚀👩‍👩‍👧 and combining e\u0301 a\u0308",
    "rare: ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero width \u00a0 nbsp",
    "<|turn>user\nHi there<turn|>\n<|turn>model\n",
    "<|channel>thought\nlet me think<channel|>The answer is 42.",
    "digits 1234567890 3.14159",
    "\n",
    " ",
]


def _corpus(n=3000, seed=0):
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) for _ in range(n)]
    return lines + TEXTS[1:]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """A tiny Gemma-style SentencePiece model: BPE, identity normalization, no dummy prefix,
    byte fallback, pad/eos/bos/unk = 0/1/2/3, a <mask> control piece and marker user symbols."""
    d = tmp_path_factory.mktemp("sp")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=400, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", control_symbols=["<mask>"], user_defined_symbols=MARKERS, byte_fallback=True,
        normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
        split_digits=True, character_coverage=1.0, minloglevel=2)
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    return d


def _byte_level_bpe(path, vocab_size=600):
    from tokenizers import AddedToken, Tokenizer as Tok, decoders, models, pre_tokenizers, trainers
    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[AddedToken(s, special=True) for s in specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(str(path))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    _byte_level_bpe(d / "tokenizer.json")
    return d


@pytest.fixture(scope="module")
def wordlevel_json(tmp_path_factory):
    from tokenizers import Tokenizer as Tok, decoders, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for w in ["hello", "world", "gemma", "diffusion", "!", "?"]:
        vocab[w] = len(vocab)
    tok = Tok(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    path = tmp_path_factory.mktemp("wl") / "tokenizer.json"
    tok.save(str(path))
    return path


# ---------------------------------------------------------------------------------------------
# SentencePiece


def test_sentencepiece_round_trip(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, text
    assert tok.encode("") == []


def test_sentencepiece_special_ids(sp_dir):
    tok = load_tokenizer(sp_dir / "tokenizer.model")
    assert tok.vocab_size == 400
    assert (tok.pad_id, tok.eos_ids, tok.bos_id, tok.unk_id) == (0, (1,), 2, 3)
    assert tok.eos_id == 1
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<eos>", "<bos>", "<unk>"]
    assert tok.piece_to_id("<mask>") == 4
    assert tok.piece_to_id("definitely-not-a-piece") is None
    for m in MARKERS:
        i = tok.piece_to_id(m)
        assert i is not None and tok.id_to_piece(i) == m
        assert tok.encode(m) == [i]  # user-defined symbols stay whole
        assert i in tok.special_ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_piece(400)


def test_sentencepiece_bos_and_control_literals(sp_dir):
    tok = load_tokenizer(sp_dir)
    body = tok.encode("hello world")
    assert tok.encode("hello world", add_bos=True) == [2] + body
    # Control pieces written in the text become their ids (as HF's tokenizer.json does).
    assert tok.encode("<bos>hello world") == [2] + body
    assert tok.encode("hello world<eos><pad><pad>") == body + [1, 0, 0]
    assert tok.encode("<mask>") == [4]
    ids = [2] + body + [1, 0]
    assert tok.decode(ids) == "<bos>hello world<eos><pad>"
    assert tok.decode(ids, skip_special=True) == "hello world"
    turn = tok.piece_to_id("<|turn>")
    assert tok.decode([turn] + tok.encode("user\nhi"), skip_special=True) == "user\nhi"
    assert tok.decode([turn] + tok.encode("user\nhi")) == "<|turn>user\nhi"
    assert tok.decode([3]) == "<unk>" and tok.decode([3], skip_special=True) == ""


def test_decode_accepts_arrays_and_checks_range(sp_dir):
    tok = load_tokenizer(sp_dir)
    ids = tok.encode("gemma diffusion")
    assert tok.decode(np.asarray(ids, np.int32)) == "gemma diffusion"
    assert tok.decode(np.asarray(ids[0])) == tok.decode([ids[0]]) == tok.decode(ids[0])
    with pytest.raises(ValueError, match="dimensional"):
        tok.decode(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, 400])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([-1])


# ---------------------------------------------------------------------------------------------
# tokenizer.json


def test_hf_json_round_trip(hf_dir):
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text, text


def test_hf_json_special_ids(hf_dir):
    tok = load_tokenizer(hf_dir / "tokenizer.json")
    assert (tok.pad_id, tok.eos_ids, tok.bos_id, tok.unk_id) == (0, (1,), 2, 3)
    raw = tokenizers.Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    assert max(tok.piece_to_id(m) for m in MARKERS) == tok.vocab_size - 1
    assert tok.id_to_piece(1) == "<eos>" and tok.piece_to_id("<eos>") == 1
    assert tok.piece_to_id("no-such-piece") is None
    turn = tok.piece_to_id("<|turn>")
    assert tok.encode("<|turn>user") == [turn] + tok.encode("user")
    ids = tok.encode("hi there", add_bos=True) + [1, 0]
    assert ids[0] == 2
    assert tok.decode(ids) == "<bos>hi there<eos><pad>"
    assert tok.decode(ids, skip_special=True) == "hi there"
    assert tok.decode([turn] + tok.encode("user"), skip_special=True) == "user"


def test_wordlevel_json(wordlevel_json):
    tok = load_tokenizer(wordlevel_json)
    assert tok.encode("hello world !") == [4, 5, 8]
    assert tok.encode("hello unknownword") == [4, 3]
    assert tok.decode([4, 5, 6]) == "hello world gemma"
    assert tok.decode([2, 4, 5, 1], skip_special=True) == "hello world"
    assert (tok.bos_id, tok.eos_ids, tok.pad_id, tok.unk_id) == (2, (1,), 0, 3)
    assert tok.vocab_size == 10


# ---------------------------------------------------------------------------------------------
# Special ids from the checkpoint's JSON files


def _write(path, obj):
    path.write_text(json.dumps(obj))


def _checkpoint(tmp_path, sp_dir, name="ckpt"):
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    return d


def test_special_ids_priority(tmp_path, sp_dir):
    d = _checkpoint(tmp_path, sp_dir)
    _write(d / "tokenizer_config.json", {"bos_token": "<bos>", "eos_token": {"content": "<mask>"},
                                         "pad_token": "<pad>",
                                         "added_tokens_decoder": {"5": {"content": "<|turn>", "special": True},
                                                                  "7": {"content": "x", "special": False}}})
    tok = load_tokenizer(d)
    assert tok.eos_ids == (4,) and tok.bos_id == 2 and tok.pad_id == 0  # tokenizer_config over the model
    assert 5 in tok.special_ids

    _write(d / "config.json", {"model_type": "diffusion_gemma", "eos_token_id": 9,
                               "text_config": {"eos_token_id": [1, 7], "bos_token_id": 2, "pad_token_id": 0}})
    assert load_tokenizer(d).eos_ids == (1, 7)  # config.json's text_config over tokenizer_config
    _write(d / "generation_config.json", {"eos_token_id": [1, 7, 8], "pad_token_id": 0})
    tok = load_tokenizer(d)
    assert tok.eos_ids == (1, 7, 8) and tok.bos_id == 2  # generation_config first
    tok = load_tokenizer(d, eos_ids=[1], bos_id=None)  # explicit arguments win
    assert tok.eos_ids == (1,) and tok.bos_id is None
    with pytest.raises(ValueError, match="no BOS"):
        tok.encode("hi", add_bos=True)

    assert read_special_ids(d)["eos_ids"] == (1, 7, 8)


def test_special_ids_errors(tmp_path, sp_dir):
    d = _checkpoint(tmp_path, sp_dir)
    _write(d / "generation_config.json", {"eos_token_id": [1, 1006]})  # an id past the tiny vocab
    with pytest.raises(ValueError, match="1006.*outside the vocabulary"):
        load_tokenizer(d)
    _write(d / "generation_config.json", {"eos_token_id": "eos"})
    with pytest.raises(ValueError, match="generation_config.json"):
        load_tokenizer(d)
    (d / "generation_config.json").unlink()
    _write(d / "tokenizer_config.json", {"eos_token": "<no_such_token>"})
    with pytest.raises(ValueError, match="tokenizer_config.json.*<no_such_token>"):
        load_tokenizer(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(d)


# ---------------------------------------------------------------------------------------------
# Finding files and errors


def test_file_discovery(tmp_path, sp_dir, hf_dir):
    both = tmp_path / "both"
    both.mkdir()
    (both / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    (both / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    assert isinstance(load_tokenizer(both), HFTokenizer)
    assert isinstance(load_tokenizer(both, prefer="sentencepiece"), SentencePieceTokenizer)
    with pytest.raises(ValueError, match="prefer"):
        load_tokenizer(both, prefer="bogus")
    # A checkpoint folder without a tokenizer, next to one that has it (e.g. an orbax step dir).
    step = both / "step_100"
    step.mkdir()
    assert find_tokenizer_file(step) == str(both / "tokenizer.json")
    # A tokenizer/ subfolder.
    sub = tmp_path / "ckpt2"
    (sub / "tokenizer").mkdir(parents=True)
    (sub / "tokenizer" / "tokenizer.model").write_bytes((sp_dir / "tokenizer.model").read_bytes())
    assert find_tokenizer_file(sub) == str(sub / "tokenizer" / "tokenizer.model")


def test_missing_and_broken_files(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*tokenizer.json"):
        load_tokenizer(missing)
    empty = tmp_path / "empty" / "ckpt"
    empty.mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(empty)
    assert str(empty) in str(e.value) and "tokenizer.json" in str(e.value) and "tokenizer.model" in str(e.value)

    bad_model = tmp_path / "bad" / "tokenizer.model"
    bad_model.parent.mkdir()
    bad_model.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match=r"tokenizer\.model.*SentencePiece"):
        load_tokenizer(bad_model.parent)
    bad_json = tmp_path / "badjson" / "tokenizer.json"
    bad_json.parent.mkdir()
    bad_json.write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(bad_json.parent)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(bad_json.parent / "tokenizer.json")


# ---------------------------------------------------------------------------------------------
# The base class


class _CharTokenizer(Tokenizer):
    """The kind of tokenizer a toy model might bring: one id per character."""

    def __init__(self, alphabet):
        self.chars = ["<pad>", "<eos>", "<bos>"] + list(alphabet)
        self._set_special_ids(bos_id=2, eos_ids=[1], pad_id=0, unk_id=None)

    @property
    def vocab_size(self):
        return len(self.chars)

    def encode(self, text, add_bos=False):
        return ([self.bos_id] if add_bos else []) + [self.chars.index(c) for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(self.chars[i] for i in ids if not (skip_special and i in self.special_ids))


def test_base_class():
    with pytest.raises(TypeError):
        Tokenizer()
    tok = _CharTokenizer("abc ")
    assert tok.encode("ab c", add_bos=True) == [2, 3, 4, 6, 5]
    assert tok.decode([2, 3, 4, 1], skip_special=True) == "ab"
    assert tok.eos_id == 1 and tok.special_ids == {0, 1, 2}
    with pytest.raises(NotImplementedError):
        tok.id_to_piece(0)
    with pytest.raises(ValueError, match="outside"):
        _CharTokenizer("ab")._set_special_ids(bos_id=2, eos_ids=[9], pad_id=0, unk_id=None)


def test_every_tokenizer_type_implements_the_protocol(sp_dir, hf_dir):
    """One interface for the pipeline, the server and the trainer: encode(text, add_bos), decode(ids,
    skip_special), the special ids and has_chat_template, with no per-type fallbacks."""
    from dgemma_jax.io.char_tokenizer import CharTokenizer

    char = CharTokenizer("0123456789=")
    sp = load_tokenizer(sp_dir)
    hf = load_tokenizer(hf_dir)
    for tok in (char, sp, hf):
        assert isinstance(tok, Tokenizer), type(tok)
        text = "12=3" if tok is char else "hello world"
        ids = tok.encode(text, add_bos=True)
        assert ids[0] == tok.bos_id and ids[1:] == tok.encode(text)
        assert tok.decode(ids[1:], skip_special=True) == text
    assert (char.bos_id, char.eos_ids, char.pad_id, char.eos_id) == (2, (1,), 0, 1)
    assert char.decode(char.encode("12") + [1] + char.encode("3")) == "12"  # stops at EOS
    assert char.id_to_piece(1) == "<eos>" and char.id_to_piece(3) == "0" and char.piece_to_id("=") == 13
    with pytest.raises(ValueError, match="outside the vocabulary"):
        char.id_to_piece(14)
    assert not char.has_chat_template and sp.has_chat_template and hf.has_chat_template


@pytest.fixture(scope="module", params=["golden", pytest.param("live", marks=pytest.mark.ref)])
def hf_gemma_tokenizer(request, sp_dir, tmp_path_factory):
    """transformers' GemmaTokenizer on sp_dir's tokenizer.model: its special ids, size, converted
    tokenizer.json and encode/decode results on TEXTS, from tests/golden/tokenizer.npz (default, no
    transformers) or run now (marker `ref`; `python -m tests.golden.make_golden tokenizer` records it)."""
    from tests.golden.reference_source import GoldenReference, LiveReference, record_path

    texts = TEXTS + ["<bos>hello<eos><pad>", "<mask> and <unk>"]
    model_bytes = (sp_dir / "tokenizer.model").read_bytes()
    if request.param == "golden":
        source = GoldenReference("tokenizer")
    else:
        transformers = pytest.importorskip("transformers")
        source = LiveReference(record_path())

    def compute():
        out_dir = tmp_path_factory.mktemp("hf_gemma_tok")
        hf = transformers.GemmaTokenizer.from_pretrained(str(sp_dir))
        hf.save_pretrained(str(out_dir))
        out = {"special": np.asarray([hf.bos_token_id, hf.eos_token_id, hf.pad_token_id]),
               "size": np.asarray(len(hf)), "tokenizer_json": np.asarray((out_dir / "tokenizer.json").read_text())}
        for i, text in enumerate(texts):
            ids = hf.encode(text, add_special_tokens=False)
            wrapped = [hf.bos_token_id] + ids + [hf.eos_token_id, hf.pad_token_id]
            out.update({f"ids_{i}": np.asarray(ids, np.int64), f"decode_{i}": np.asarray(hf.decode(ids)),
                        f"decode_wrapped_{i}": np.asarray(hf.decode(wrapped)),
                        f"decode_wrapped_skip_{i}": np.asarray(hf.decode(wrapped, skip_special_tokens=True))})
        return out

    value = source.value("gemma_tokenizer", compute, model_bytes, texts)
    yield texts, value
    if request.param == "live":
        source.flush()


def test_sentencepiece_agrees_with_transformers_gemma_tokenizer(sp_dir, tmp_path, hf_gemma_tokenizer):
    """transformers' GemmaTokenizer (its SentencePiece -> tokenizer.json conversion, what Gemma
    checkpoints ship) and our readers of tokenizer.model and of the converted tokenizer.json give
    the same ids and text."""
    texts, hf = hf_gemma_tokenizer
    (tmp_path / "tokenizer.json").write_text(str(hf["tokenizer_json"]))
    sp_tok, json_tok = load_tokenizer(sp_dir), load_tokenizer(tmp_path / "tokenizer.json")
    assert tuple(int(x) for x in hf["special"]) == (sp_tok.bos_id, sp_tok.eos_id, sp_tok.pad_id)
    assert int(hf["size"]) == sp_tok.vocab_size == json_tok.vocab_size
    for i, text in enumerate(texts):
        ids = [int(x) for x in hf[f"ids_{i}"]]
        assert sp_tok.encode(text) == ids == json_tok.encode(text), text
        assert sp_tok.decode(ids) == str(hf[f"decode_{i}"]) == json_tok.decode(ids)
        wrapped = [sp_tok.bos_id] + ids + [sp_tok.eos_id, sp_tok.pad_id]
        assert sp_tok.decode(wrapped) == str(hf[f"decode_wrapped_{i}"])
        if not any(m in text for m in MARKERS):  # our reader also skips marker pieces; this HF conversion keeps them
            assert sp_tok.decode(wrapped, skip_special=True) == str(hf[f"decode_wrapped_skip_{i}"])


def test_a_training_recipe_reads_tokenizer_json_with_the_librarys_tokenizer(hf_dir, wordlevel_json):
    """`data.tokenizer: "hf"` in a recipe loads the same tokenizer as inference (one HFTokenizer class),
    special ids included, from a checkpoint directory or the file itself."""
    from dgemma_jax.training.recipe import DataSection
    from dgemma_jax.training.train import build_tokenizer

    def data(path):
        return DataSection(prompt_length=8, num_canvases=1, batch_size=1, tokenizer="hf", tokenizer_path=str(path))

    for path in (hf_dir, hf_dir / "tokenizer.json"):
        tok = build_tokenizer(data(path))
        assert isinstance(tok, HFTokenizer)
        assert (tok.pad_id, tok.eos_ids, tok.bos_id) == (0, (1,), 2)
        assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]
    tok = build_tokenizer(data(wordlevel_json))
    assert tok.decode(tok.encode("hello world")) == "hello world" and tok.vocab_size == 10
