"""The Gemma 4 chat format of `dgemma_jax.io.chat` against transformers' `apply_chat_template`.

transformers 5.23 ships no Gemma 4 chat template text (checked: nothing under the installed
package contains a `<|turn>` Jinja template; the template is a file of the google/gemma-4-* model
repos). So the reference below, `GEMMA4_TEXT_TEMPLATE`, is a Jinja template written for these
tests from the logic of the official Gemma 4 `chat_template.jinja` (text messages only: system /
developer, user, assistant; thinking on/off; generation prompt with the empty thought channel;
thinking blocks dropped from model turns; continued assistant turns; image/audio/video parts).
It is run through transformers' own machinery (a PreTrainedTokenizerFast whose `chat_template`
is set to it) and compared with our Python renderer, and a few outputs are also pinned as
literal strings written out by hand from the format.

transformers' outputs come from tests/golden/chat_template.npz by default (no torch or transformers
needed; each value's inputs are hashed and checked) and, under the `ref` marker, from transformers run
now: every comparison runs against both. `python -m tests.golden.make_golden chat_template` rewrites
the file from the live run.
"""

import hashlib
import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from dgemma_jax.io.chat import (  # noqa: E402
    EMPTY_THOUGHT, history_without_thinking, load_chat_template, render_chat, strip_thinking)
from dgemma_jax.io.tokenizer import load_tokenizer  # noqa: E402

GEMMA4_TEXT_TEMPLATE = r"""
{%- macro drop_thoughts(text) -%}
    {%- set acc = namespace(out='') -%}
    {%- for chunk in text.split('<channel|>') -%}
        {%- if '<|channel>' in chunk -%}
            {%- set acc.out = acc.out + chunk.split('<|channel>')[0] -%}
        {%- else -%}
            {%- set acc.out = acc.out + chunk -%}
        {%- endif -%}
    {%- endfor -%}
    {{- acc.out | trim -}}
{%- endmacro -%}
{%- set thinking_on = enable_thinking is defined and enable_thinking -%}
{%- set has_system = messages[0]['role'] in ['system', 'developer'] -%}
{{- bos_token -}}
{%- if thinking_on or has_system -%}
    {{- '<|turn>system\n' -}}
    {%- if thinking_on -%}{{- '<|think|>\n' -}}{%- endif -%}
    {%- if has_system -%}
        {%- set sys = messages[0]['content'] -%}
        {%- if sys is string -%}
            {{- sys | trim -}}
        {%- elif sys is sequence -%}
            {%- for part in sys -%}{{- part['text'] | trim + ' ' -}}{%- endfor -%}
        {%- endif -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- set turns = messages[1:] if has_system else messages -%}
{%- for message in turns -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- set continued = role == 'model' and not loop.first and loop.previtem['role'] == 'assistant' -%}
    {%- if not continued -%}{{- '<|turn>' + role + '\n' -}}{%- endif -%}
    {%- set body = message['content'] -%}
    {%- if body is string -%}
        {%- if role == 'model' -%}{{- drop_thoughts(body) -}}{%- else -%}{{- body | trim -}}{%- endif -%}
    {%- elif body is sequence -%}
        {%- for part in body -%}
            {%- if part['type'] == 'text' -%}
                {%- if role == 'model' -%}
                    {{- drop_thoughts(part['text']) -}}
                {%- else -%}
                    {{- part['text'] | trim -}}
                {%- endif -%}
            {%- elif part['type'] in ['image', 'audio', 'video'] -%}
                {{- '<|' + part['type'] + '|>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n' -}}
    {%- if not thinking_on -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""

from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json as _gemma_like_tokenizer_json  # noqa: E402

THOUGHT = "<|channel>thought\nThe user wants a number. 6*7=42.<channel|>"

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "  What is 6 x 7?  \n"},
    ],
    "multi_turn_with_thinking": [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "assistant", "content": THOUGHT + "42"},
        {"role": "user", "content": "And 6 x 8?"},
        {"role": "assistant", "content": "<|channel>thought\nAdd six.<channel|>\n\n48\n"},
        {"role": "user", "content": "Thanks. Now 9 x 9?"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    "developer_and_unicode": [
        {"role": "developer", "content": "\tBe kind. 日本語で答えて。 "},
        {"role": "user", "content": "naïve café 😀\n\nline two  "},
        {"role": "assistant", "content": "  はい 😀  "},
    ],
    "odd_thinking_blocks": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a <|channel>x<channel|>b <|channel>y<channel|> c<channel|>d <|channel>tail"},
        {"role": "user", "content": "q2"},
    ],
    "continued_assistant": [
        {"role": "user", "content": "Write two lines."},
        {"role": "assistant", "content": "Line one."},
        {"role": "assistant", "content": "Line two."},
    ],
    "content_parts": [
        {"role": "system", "content": [{"type": "text", "text": " part A "}, {"type": "text", "text": "part B"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " Describe this. "},
                                     {"type": "audio"}, {"type": "video"}]},
        {"role": "assistant", "content": [{"type": "text", "text": THOUGHT + " A cat."}]},
        {"role": "user", "content": "And the sound?"},
    ],
    "empty_and_none_content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "   "},
    ],
    "mid_conversation_system": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": " Switch to French. "},
        {"role": "user", "content": "Bonjour"},
    ],
    "prefill_last_assistant": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "The answer is"},
    ],
}

GOLDEN = [
    # (name, add_generation_prompt, enable_thinking, expected)
    ("user", True, False, "<bos><|turn>user\nHello!<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    ("user", True, True, "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHello!<turn|>\n<|turn>model\n"),
    ("user", False, False, "<bos><|turn>user\nHello!<turn|>\n"),
    ("system_user", True, True,
     "<bos><|turn>system\n<|think|>\nYou are a terse assistant.<turn|>\n<|turn>user\nWhat is 6 x 7?<turn|>\n"
     "<|turn>model\n"),
    ("multi_turn_with_thinking", True, False,
     "<bos><|turn>system\nAnswer with a number.<turn|>\n"
     "<|turn>user\nWhat is 6 x 7?<turn|>\n<|turn>model\n42<turn|>\n"
     "<|turn>user\nAnd 6 x 8?<turn|>\n<|turn>model\n48<turn|>\n"
     "<|turn>user\nThanks. Now 9 x 9?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"),
    ("continued_assistant", False, False,
     "<bos><|turn>user\nWrite two lines.<turn|>\n<|turn>model\nLine one.<turn|>\nLine two.<turn|>\n"),
    ("odd_thinking_blocks", False, False,
     "<bos><|turn>user\nq<turn|>\n<|turn>model\na b  cd<turn|>\n<|turn>user\nq2<turn|>\n"),
    ("content_parts", False, False,
     "<bos><|turn>system\npart A part B <turn|>\n<|turn>user\n<|image|>Describe this.<|audio|><|video|><turn|>\n"
     "<|turn>model\nA cat.<turn|>\n<|turn>user\nAnd the sound?<turn|>\n"),
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma4_like")
    _gemma_like_tokenizer_json(d / "tokenizer.json")
    return d


class _HFChat:
    """transformers' `apply_chat_template` with GEMMA4_TEXT_TEMPLATE, live or from the golden file."""

    def __init__(self, source, tok_dir, tok=None):
        self.source, self.dir, self.tok = source, tok_dir, tok
        with open(tok_dir / "tokenizer.json") as f:
            self.tokenizer_json = f.read()

    def _value(self, kind, compute, messages, add_generation_prompt, enable_thinking):
        inputs = json.dumps([kind, messages, add_generation_prompt, enable_thinking], sort_keys=True)
        key = f"{kind}/{hashlib.sha256(inputs.encode()).hexdigest()[:20]}"
        extra = (self.tokenizer_json,) if kind == "ids" else ()
        return self.source.value(key, compute, inputs, GEMMA4_TEXT_TEMPLATE, *extra)

    def render(self, messages, add_generation_prompt=True, enable_thinking=None):
        """enable_thinking=None: the argument is not passed."""
        kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        return str(self._value("render", lambda: np.asarray(self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)),
            messages, add_generation_prompt, enable_thinking))

    def ids(self, messages, enable_thinking):
        def compute():
            hf = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              enable_thinking=enable_thinking)
            return np.asarray(list(hf["input_ids"] if hasattr(hf, "keys") else hf), np.int64)

        return [int(i) for i in self._value("ids", compute, messages, True, enable_thinking)]


@pytest.fixture(scope="module", params=["golden", pytest.param("live", marks=pytest.mark.ref)])
def hf_tok(request, tok_dir, tmp_path_factory):
    from tests.golden.reference_source import GoldenReference, LiveReference, record_path

    if request.param == "golden":
        # the tokenizer helper's vocabulary order varies between processes: use the file transformers was given
        golden = GoldenReference("chat_template")
        d = tmp_path_factory.mktemp("gemma4_like_golden")
        (d / "tokenizer.json").write_text(str(golden.value("tokenizer_json", None)))
        yield _HFChat(golden, d)
        return
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<bos>",
                                               eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = GEMMA4_TEXT_TEMPLATE
    assert tok.convert_tokens_to_ids(["<|turn>", "<turn|>", "<bos>"]) == [105, 106, 2]
    live = LiveReference(record_path())
    live.value("tokenizer_json", lambda: np.asarray((tok_dir / "tokenizer.json").read_text()))
    yield _HFChat(live, tok_dir, tok)
    live.flush()


def _hf_render(hf_tok, messages, add_generation_prompt, enable_thinking):
    return hf_tok.render(messages, add_generation_prompt, enable_thinking)


CASES = [(name, gen, think) for name in CONVERSATIONS for gen in (True, False) for think in (False, True)]


@pytest.mark.parametrize("name,add_generation_prompt,enable_thinking", CASES)
def test_render_matches_transformers(hf_tok, name, add_generation_prompt, enable_thinking):
    messages = CONVERSATIONS[name]
    ours = render_chat(messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    assert ours == _hf_render(hf_tok, messages, add_generation_prompt, enable_thinking)
    # Our Jinja runner gives what transformers' does on the same template.
    assert render_chat(messages, add_generation_prompt, enable_thinking, chat_template=GEMMA4_TEXT_TEMPLATE) == ours


def test_enable_thinking_default_is_off(hf_tok):
    messages = CONVERSATIONS["system_user"]
    hf = hf_tok.render(messages, True)  # no enable_thinking
    assert render_chat(messages) == hf
    assert hf.endswith("<|turn>model\n" + EMPTY_THOUGHT)


@pytest.mark.parametrize("name,add_generation_prompt,enable_thinking,expected", GOLDEN)
def test_golden_strings(hf_tok, name, add_generation_prompt, enable_thinking, expected):
    messages = CONVERSATIONS[name]
    assert render_chat(messages, add_generation_prompt, enable_thinking) == expected
    assert _hf_render(hf_tok, messages, add_generation_prompt, enable_thinking) == expected


def test_token_ids_match_transformers(hf_tok):
    ours_tok = load_tokenizer(hf_tok.dir)
    for name, messages in CONVERSATIONS.items():
        for think in (False, True):
            hf_ids = hf_tok.ids(messages, think)
            ids = ours_tok.encode(render_chat(messages, enable_thinking=think))
            assert ids == hf_ids, name
            assert ids[0] == 2 and ids.count(2) == 1  # exactly one BOS
            if name != "continued_assistant":  # every turn is closed except the open model turn
                assert ids.count(105) == ids.count(106) + 1
            tail = [105] + ours_tok.encode("model\n") + ([] if think else ours_tok.encode(EMPTY_THOUGHT))
            assert ids[-len(tail):] == tail
    assert ours_tok.encode(render_chat(CONVERSATIONS["user"], enable_thinking=True)).count(107) == 1


def test_bos_token_and_empty_thought_arguments():
    text = render_chat(CONVERSATIONS["user"], bos_token="")
    assert text == "<|turn>user\nHello!<turn|>\n<|turn>model\n" + EMPTY_THOUGHT
    # The E-series Gemma 4 templates leave the empty thought channel out of the generation prompt.
    e_series = render_chat(CONVERSATIONS["user"], empty_thought_channel=False)
    assert e_series == "<bos><|turn>user\nHello!<turn|>\n<|turn>model\n"
    assert render_chat(CONVERSATIONS["user"], enable_thinking=True, empty_thought_channel=False) == \
        render_chat(CONVERSATIONS["user"], enable_thinking=True)


# ---------------------------------------------------------------------------------------------
# Model output and history


@pytest.mark.parametrize("output,thought,answer", [
    ("<|channel>thought\nLet me add: 2+2=4.<channel|>The answer is 4.<turn|>", "Let me add: 2+2=4.",
     "The answer is 4."),
    ("<|channel>thought\n\n  multi\nline\n<channel|>\n\nAnswer\n<turn|><eos><pad><pad>", "multi\nline", "Answer"),
    ("Just an answer.<turn|>", "", "Just an answer."),
    ("Just an answer.<eos><pad>", "", "Just an answer."),
    ("<|channel>thought\n<channel|>Answer without thoughts", "", "Answer without thoughts"),
    ("<|channel>thought\nran out of tokens", "ran out of tokens", ""),
    ("prompt opened the channel\n<channel|>the answer", "prompt opened the channel", "the answer"),
    ("<|channel>thought\none<channel|>mid <|channel>thought\ntwo<channel|> end", "one\ntwo", "mid  end"),
    ("", "", ""),
])
def test_strip_thinking(output, thought, answer):
    assert strip_thinking(output) == (thought, answer)


def test_history_without_thinking(hf_tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "assistant", "content": THOUGHT + "42<turn|>", "reasoning_content": "hidden"},
        {"role": "user", "content": "And with <|channel> in user text?"},
        {"role": "assistant", "content": [{"type": "text", "text": THOUGHT + "48"}], "reasoning": "r"},
        {"role": "user", "content": "ok"},
    ]
    before = json.dumps(messages)
    clean = history_without_thinking(messages)
    assert json.dumps(messages) == before  # the input is not changed
    assert clean[2] == {"role": "assistant", "content": "42"}
    assert clean[4] == {"role": "assistant", "content": [{"type": "text", "text": "48"}]}
    assert clean[3] == messages[3] and clean[0] == messages[0]
    for think in (False, True):
        rendered = render_chat(clean, enable_thinking=think)
        assert "6*7" not in rendered and "hidden" not in rendered
        assert rendered == _hf_render(hf_tok, clean, True, think)
    # The template already drops thinking blocks, so rendering the raw history gives the same prompt
    # (up to the `<turn|>` that a raw model output may still carry).
    raw = [dict(m) for m in messages]
    raw[2]["content"] = THOUGHT + "42"
    assert render_chat(raw) == render_chat(history_without_thinking(raw))


# ---------------------------------------------------------------------------------------------
# Errors and checkpoint templates


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        render_chat([])
    with pytest.raises(ValueError, match="role"):
        render_chat([{"content": "no role"}])
    with pytest.raises(TypeError, match="content"):
        render_chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError):
        render_chat("hello")
    with pytest.raises(ValueError, match="chat_template"):
        render_chat([{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}])
    with pytest.raises(ValueError, match="chat_template"):
        render_chat([{"role": "tool", "content": "{}"}])
    with pytest.raises(TypeError, match="chat_template"):
        render_chat([{"role": "user", "content": "hi"}], tools=[])


def test_load_chat_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": GEMMA4_TEXT_TEMPLATE}]}))
    assert load_chat_template(tmp_path) == GEMMA4_TEXT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    template = load_chat_template(tmp_path)
    assert render_chat([{"role": "user", "content": "x"}], chat_template=template) == "<bos>x"
    assert load_chat_template(tmp_path / "chat_template.jinja") == template
    with pytest.raises(FileNotFoundError):
        load_chat_template(tmp_path / "missing")
    with pytest.raises(Exception, match="boom"):
        render_chat([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('boom') }}")
