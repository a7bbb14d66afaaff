"""Chat SFT data (`data.kind=chat`, `training.data.ChatSource`): JSON lines of {"messages": [...]}
rendered with the Gemma 4 template, one example per assistant turn, losses on the assistant tokens.

A character tokenizer makes every character one token, so the expected token spans below are
character offsets counted by hand in the hand-written rendered text.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax.training.data import ChatSource, Layout, chat_turns
from dgemma_jax.training.objective import ar_loss, gather_canvas
from dgemma_jax.io.char_tokenizer import CharTokenizer
from tests.helpers.kill_harness import metrics_by_step
from test_training_resume import _finish, _kill_after_two_checkpoints, _start

CHARS = "\n <>|abcdefghijklmnopqrstuvwxyz"
TOK = CharTokenizer(CHARS)
EOS = TOK.eos_id

THREE_TURNS = {"messages": [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "cya"},
]}
# written by hand from the Gemma 4 template (thinking off: the generation prompt ends with the empty
# thought channel; earlier model turns appear as <|turn>model\nANSWER<turn|>\n)
CONTEXT_1 = ("<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n"
             "<|turn>model\n<|channel>thought\n<channel|>")
CONTEXT_2 = ("<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nyo<turn|>\n"
             "<|turn>user\nand<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
CONTEXT_3 = ("<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nyo<turn|>\n"
             "<|turn>user\nand<turn|>\n<|turn>model\nok<turn|>\n<|turn>user\nbye<turn|>\n"
             "<|turn>model\n<|channel>thought\n<channel|>")
# (context length, assistant span [start, end)) counted by hand: the turn's answer plus its <turn|>
SPANS = [(98, (98, 107)), (144, (144, 153)), (190, (190, 200))]
ANSWERS = ["yo<turn|>", "ok<turn|>", "cya<turn|>"]


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_three_turn_loss_masks_cover_exactly_the_assistant_tokens(tmp_path):
    assert [len(c) for c in (CONTEXT_1, CONTEXT_2, CONTEXT_3)] == [98, 144, 190]  # the hand count
    lay = Layout(prompt_length=192, num_canvases=3, canvas_length=4)
    src = ChatSource(_write(tmp_path / "chat.jsonl", [THREE_TURNS]), TOK.encode, lay, batch_size=3, seed=0)
    assert len(src) == 3 and src.stats["context_tokens_dropped"] == 0 and src.stats["responses_truncated"] == 0
    batch = src.batch(0)  # the 3 examples of epoch 0, in shuffled order: put them back in turn order
    order = np.argsort(batch["prompt_lengths"])
    batch = {k: v[order] for k, v in batch.items()}
    tokens = batch["tokens"]
    L = lay.canvas_length
    for row, (ctx, answer, (plen, (a, b))) in enumerate(zip((CONTEXT_1, CONTEXT_2, CONTEXT_3), ANSWERS, SPANS)):
        assert TOK.decode(tokens[row, :plen]) == ctx
        assert batch["prompt_lengths"][row] == plen
        assert TOK.decode(tokens[row, a:b]) == answer
        n = -(-(b - a + 1) // L)  # answer + EOS, rounded up to whole canvases
        assert batch["num_canvases"][row] == n and batch["lengths"][row] == plen + n * L
        # diffusion loss: the valid canvases are exactly the assistant span, then EOS to the canvas end
        canvases = np.concatenate([np.asarray(gather_canvas(jnp.asarray(tokens[row:row + 1]),
                                                            jnp.asarray([plen + c * L]), L))[0] for c in range(n)])
        np.testing.assert_array_equal(canvases[: b - a], TOK.encode(answer))
        assert (canvases[b - a:] == EOS).all() and len(canvases) == n * L
        assert not (set(range(a, plen + n * L)) & set(range(0, plen)))

    # encoder AR loss: which target positions move the loss (gradient w.r.t. the logits)
    B, T = tokens.shape
    logits = jax.random.normal(jax.random.key(0), (B, T, TOK.vocab_size))
    args = (jnp.asarray(tokens), jnp.asarray(batch["lengths"]), jnp.asarray(batch["prompt_lengths"]))
    for on_prompt in (False, True):
        g = jax.grad(lambda lg: ar_loss(lg, *args, on_prompt))(logits)
        scored = np.abs(np.asarray(g)).sum(-1) > 0  # logits at position p score target p + 1
        for row, (plen, (a, b)) in enumerate(SPANS):
            targets = set((np.nonzero(scored[row])[0] + 1).tolist())
            end = int(batch["lengths"][row])
            if on_prompt:  # "all": every token after the first, through the EOS fill
                assert targets == set(range(1, end))
            else:  # "assistant": the answer, its EOS and the EOS fill of its last canvas, nothing else
                assert targets == set(range(a, end)) and min(targets) == a == plen
                assert all(tokens[row, t] == EOS for t in targets if t >= b)


def test_thinking_turns_follow_the_template():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "thinking": "greet"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "<|channel>thought\nend<channel|>cya"}]
    (c1, r1), (c2, r2) = chat_turns(msgs)
    assert c1 == "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n"
    assert r1 == "<|channel>thought\ngreet<channel|>yo<turn|>"
    # the earlier turn's thought is not fed back into the history
    assert c2 == ("<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\nyo<turn|>\n"
                  "<|turn>user\nbye<turn|>\n<|turn>model\n")
    assert r2 == "<|channel>thought\nend<channel|>cya<turn|>"
    # thinking switched off for the row: thoughts dropped, the empty thought channel in the prompt
    (c1, r1), _ = chat_turns(msgs, enable_thinking=False)
    assert c1.endswith("<|turn>model\n<|channel>thought\n<channel|>") and r1 == "yo<turn|>"


@pytest.mark.parametrize("line, what", [
    ('{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ('{"prompt": "hi", "response": "yo"}', '"messages" list'),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0] needs a \"role\""),
    ('{"messages": [{"role": "user"}]}', "messages[0] needs a string"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}', "after the first"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
     '{"role": "assistant", "content": "c"}]}', "consecutive assistant"),
    ('{"messages": [{"role": "assistant", "content": "b"}]}', "starts with an assistant"),
    ('{"messages": [{"role": "user", "content": "a"}], "enable_thinking": "yes"}', "enable_thinking"),
])
def test_malformed_lines_name_the_file_and_line(tmp_path, line, what):
    good = json.dumps(THREE_TURNS)
    path = _write(tmp_path / "bad.jsonl", [good, "", line, good])
    with pytest.raises(ValueError) as e:
        ChatSource(path, TOK.encode, Layout(200, 3, 4), batch_size=2)
    msg = str(e.value)
    assert msg.startswith(f"{path} line 3:") and what in msg and "\n" not in msg, msg


def test_truncation_and_drop_counts(tmp_path):
    def conv(user, answer):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    # context = "<bos><|turn>user\n" (17) + user + "<turn|>\n<|turn>model\n<|channel>thought\n<channel|>" (49)
    # response = answer + "<turn|>" (7); the layout holds P = 70 context tokens and C * L = 12 response tokens
    rows = [conv("ab", "x"),          # context 68, response 8: fits
            conv("abcdefg", "x"),     # context 73: 3 context tokens over
            conv("a", "abcde"),       # context 67, response 12: no room for the EOS (truncated, 0 tokens lost)
            conv("abcdef", "abcdefgh"),  # context 72 (2 over), response 15 (3 over)
            {"messages": [{"role": "user", "content": "nobody answers"}]}]
    path = _write(tmp_path / "long.jsonl", rows)
    lay = Layout(prompt_length=70, num_canvases=3, canvas_length=4)
    src = ChatSource(path, TOK.encode, lay, batch_size=4, seed=3)
    assert src.stats == dict(conversations=5, assistant_turns=4, examples=4, conversations_without_assistant=1,
                             examples_dropped=0, contexts_truncated=2, context_tokens_dropped=5,
                             responses_truncated=2, response_tokens_dropped=3)
    b = src.batch(0)
    assert sorted(b["prompt_lengths"].tolist()) == [67, 68, 70, 70]
    responses = [TOK.decode(b["tokens"][r, b["prompt_lengths"][r]:b["lengths"][r]]) for r in range(4)]
    assert sorted(responses) == sorted(["x<turn|>", "x<turn|>", "abcde<turn|>", "abcdefgh<tur"])
    long_row = responses.index("abcdefgh<tur")  # the response keeps its first 12 tokens, no EOS
    assert TOK.decode(b["tokens"][long_row, :70]) == ("<bos><|turn>user\nabcdef<turn|>\n<|turn>model\n"
                                                      "<|channel>thought\n<channel|>")[2:]  # its last 70 tokens
    assert "dropped 0 examples" in src.summary() and "truncated 2 contexts (5 tokens)" in src.summary()

    dropped = ChatSource(path, TOK.encode, lay, batch_size=4, seed=3, overflow="drop")
    assert len(dropped) == 1 and dropped.stats["examples_dropped"] == 3 and dropped.stats["examples"] == 1
    assert dropped.stats["context_tokens_dropped"] == 0 and dropped.stats["responses_truncated"] == 0
    with pytest.raises(ValueError, match="data.overflow must be one of"):
        ChatSource(path, TOK.encode, lay, batch_size=4, overflow="split")


def test_epochs_are_deterministic_permutations(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q" + "abcdefghij"[i]},
                          {"role": "assistant", "content": "abcdefghij"[i]}]} for i in range(10)]
    path = _write(tmp_path / "ten.jsonl", rows)
    lay = Layout(prompt_length=70, num_canvases=2, canvas_length=4)
    a = ChatSource(path, TOK.encode, lay, batch_size=5, seed=7)
    b = ChatSource(path, TOK.encode, lay, batch_size=5, seed=7)
    answers = [[r[0] for _, r in a.example_texts(i)] for i in range(4)]  # 2 batches per epoch
    for epoch in range(2):
        assert sorted(answers[2 * epoch] + answers[2 * epoch + 1]) == list("abcdefghij")
    assert answers[:2] != answers[2:]
    for i in (3, 0, 2, 1):  # any order, a fresh source: the same batches
        np.testing.assert_array_equal(b.batch(i)["tokens"], a.batch(i)["tokens"])
    c = ChatSource(path, TOK.encode, lay, batch_size=5, seed=8)
    assert [[r[0] for _, r in c.example_texts(i)] for i in range(2)] != answers[:2]


def test_ar_loss_option_maps_onto_the_objective():
    from dgemma_jax.training.recipe import DataSection
    from dgemma_jax.training.train import objective_options

    def data(kind, ar_loss):
        return DataSection(prompt_length=8, num_canvases=1, batch_size=1, kind=kind, path="x.jsonl", ar_loss=ar_loss)

    assert objective_options(data("chat", "assistant"), {})["ar_on_prompt"] is False
    assert objective_options(data("chat", "all"), {"ar_on_prompt": True})["ar_on_prompt"] is True
    with pytest.raises(ValueError, match="contradicts objective.ar_on_prompt"):
        objective_options(data("chat", "assistant"), {"ar_on_prompt": True})
    with pytest.raises(ValueError, match="data.ar_loss must be one of"):
        objective_options(data("chat", "prompt"), {})
    with pytest.raises(ValueError, match="applies to data.kind='chat' only"):
        objective_options(data("jsonl", "assistant"), {})


# ---------------------------------------------------------------------------- a run on chat data
def _chat_rows():
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
    rows = []
    for i, w in enumerate(words):
        msgs = [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w[::-1]}]
        if i % 2:
            msgs += [{"role": "user", "content": "again"}, {"role": "assistant", "content": w}]
        rows.append({"messages": msgs})
    return rows


def _overrides(path):
    return {"data.kind": "chat", "data.path": path, "data.tokenizer": "char", "data.chars": CHARS,
            "data.prompt_length": 96, "data.num_canvases": 3, "data.batch_size": 4, "data.ar_loss": "assistant",
            "objective.ar_on_prompt": False, "model.overrides.vocab_size": 40,
            "model.overrides.max_position_embeddings": 128, "train.num_steps": 16, "train.checkpoint_every": 4}


def test_chat_run_kill9_then_resume_matches_uninterrupted_run(tmp_path):
    path = _write(tmp_path / "chat.jsonl", _chat_rows())
    cache = tmp_path / "jax_cache"
    full = tmp_path / "full"
    out = _finish(_start(full, cache, **_overrides(path)))
    with open(os.path.join(full, "data_stats.json")) as f:
        stats = json.load(f)
    # 8 conversations, 12 assistant turns; the 4 second turns' contexts exceed 96 tokens
    assert stats["conversations"] == 8 and stats["examples"] == 12 and stats["contexts_truncated"] == 4
    assert "chat data" in out and "truncated 4 contexts" in out

    killed = tmp_path / "killed"
    resumed_from = _kill_after_two_checkpoints(_start(killed, cache, **_overrides(path),
                                                      **{"train.throttle_s": 0.3}), killed)
    assert 8 <= resumed_from < 16, resumed_from

    _finish(_start(killed, cache, **_overrides(path)))
    ref, got = metrics_by_step(full), metrics_by_step(killed)
    assert sorted(ref) == sorted(got) == list(range(1, 17))
    for s in range(1, 17):
        for k in ("loss", "diffusion_loss", "ar_loss", "grad_norm", "mean_t", "lr"):
            assert got[s][k] == ref[s][k], (s, k, got[s][k], ref[s][k])
    assert np.isfinite([ref[s]["loss"] for s in ref]).all()
