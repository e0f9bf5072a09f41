"""Tokenizer loading, BOS handling, EOS ids and chat templates against transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from llmctl.errors import InvalidRequest, OptionError
from llmctl.model.tokenizer import Tokenizer

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] | trim "
    "+ ' [/INST]' }}{% else %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# SmolLM3-style: the assistant's text sits in a {% generation %} block (for training masks).
GENERATION_BLOCK_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|user|>' + message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}],
    },
]


@pytest.fixture
def model_dir(tmp_path, stories_dir):
    """stories260K's tokenizer files in a directory of our own, to edit freely."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(stories_dir / name, tmp_path / name)
    return tmp_path


def set_config(model_dir, **changes) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_encode_matches_reference_prompts(stories_tokenizer, stories_dir) -> None:
    reference = json.loads((stories_dir / "reference_greedy.json").read_text())
    for result in reference["results"]:
        assert stories_tokenizer.encode(result["prompt"]) == result["prompt_ids"]
    for case in reference["tokenizer_vs_sentencepiece_mismatches"]:
        assert stories_tokenizer.encode(case["text"]) == case["hf"]


def test_no_double_bos(stories_tokenizer) -> None:
    ids = stories_tokenizer.encode("<s>Once upon")
    assert ids[0] == 1 and ids.count(1) == 1
    assert stories_tokenizer.encode("Once upon", add_special_tokens=False)[0] != 1


def test_add_bos_token_false_is_honoured(model_dir) -> None:
    set_config(model_dir, add_bos_token=False)
    assert Tokenizer.from_dir(model_dir).encode("Once upon")[0] != 1


def test_eos_ids_from_generation_config_and_config(model_dir) -> None:
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert Tokenizer.from_dir(model_dir).eos_token_ids == (2, 7, 9)


@pytest.mark.parametrize("template", [LLAMA2_TEMPLATE, CHATML_TEMPLATE, GENERATION_BLOCK_TEMPLATE])
def test_chat_template_renders_like_transformers(model_dir, template) -> None:
    transformers = pytest.importorskip("transformers")
    set_config(model_dir, chat_template=template)
    ours = Tokenizer.from_dir(model_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = [
        {**m, "content": m["content"] if isinstance(m["content"], str) else "Tell me a story"}
        for m in CONVERSATION
    ]
    expected_text = theirs.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION) == expected_text
    expected_ids = theirs.apply_chat_template(plain, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected_ids, list):  # transformers 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert ours.encode_chat(CONVERSATION) == list(expected_ids)


def test_template_errors_are_invalid_requests(model_dir) -> None:
    set_config(model_dir, chat_template=LLAMA2_TEMPLATE)
    tokenizer = Tokenizer.from_dir(model_dir)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        tokenizer.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(InvalidRequest, match="only text"):
        tokenizer.encode_chat([{"role": "user", "content": [{"type": "image_url"}]}])


def test_chat_template_option_file_or_inline(model_dir, tmp_path) -> None:
    template_file = tmp_path / "t.jinja"
    template_file.write_text(CHATML_TEMPLATE)
    from_file = Tokenizer.from_dir(model_dir, chat_template=str(template_file))
    inline = Tokenizer.from_dir(model_dir, chat_template=CHATML_TEMPLATE)
    assert from_file.chat_template == inline.chat_template == CHATML_TEMPLATE
    with pytest.raises(OptionError, match="neither an existing file nor a Jinja template"):
        Tokenizer.from_dir(model_dir, chat_template="no-such-file.jinja")
    with pytest.raises(OptionError, match="does not compile"):
        Tokenizer.from_dir(model_dir, chat_template="{% for %}")


def test_chat_template_jinja_file_is_found(model_dir) -> None:
    (model_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    assert Tokenizer.from_dir(model_dir).chat_template == CHATML_TEMPLATE


def test_no_template_joins_contents_as_plain_continuation(stories_tokenizer) -> None:
    assert not stories_tokenizer.has_chat_template
    ids = stories_tokenizer.encode_chat(CONVERSATION)
    assert ids == stories_tokenizer.encode("Hi there\nHello!\nTell me a story")
    # Tool definitions come first, one JSON line each: the model sees them too.
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    with_tools = stories_tokenizer.encode_chat(CONVERSATION, tools=[tool])
    expected = json.dumps(tool) + "\nHi there\nHello!\nTell me a story"
    assert with_tools == stories_tokenizer.encode(expected)
