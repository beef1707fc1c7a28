"""Chat templates render the string transformers' apply_chat_template renders, are read from a base folder, and
mask everything but the answers and their EOS token under an HF tokenizer."""
import json
import os

import pytest

from minigpt.errors import InputError
from minituner.sft.encoders import plain_encoder, special_prefix
from minituner.sft.examples import IGNORE, tokenize_record, tokenize_records
from minituner.sft.formats import Record
from minituner.sft.templates import (DEFAULT_EOS, DEFAULT_TEMPLATE, ChatTemplate, default_template,
                                     load_chat_template, render_template)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Qwen2-style ChatML, written over several indented lines so that trim_blocks and lstrip_blocks matter.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' -}}
{% endif %}
"""
# Llama-3-Instruct's template (bos_token, trim), plus raise_exception, tojson and strftime_now.
LLAMA3 = (
    "{% if tools is defined %}{{ tools | tojson }}{% endif %}{{ strftime_now('') }}"
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('Conversations start with a user or system "
    "message') }}{% endif %}"
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello! <b>é</b> "}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "And 2+2?"},
     {"role": "assistant", "content": "Quatre."}],
]


def hf_tokenizer(template: str, eos: str, bos: str = "<|begin_of_text|>"):
    """A transformers fast tokenizer over a small byte-level BPE trained here (no download)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(c) for c in CONVERSATIONS] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos,
                                                chat_template=template)


# ChatML with transformers' {% generation %} tag around the assistant's answer (as TRL's assistant_only_loss wants).
CHATML_GEN = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}
    {% endif %}
    {% if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' -}}
        {% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' -}}
    {% else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' -}}
{% endif %}
"""


@pytest.mark.parametrize("source, eos", [(CHATML, "<|im_end|>"), (CHATML_GEN, "<|im_end|>"), (LLAMA3, "<|eot_id|>")],
                         ids=["chatml", "chatml-generation-tag", "llama3"])
@pytest.mark.parametrize("gen", [False, True])
def test_render_equals_transformers(source, eos, gen):
    hf = hf_tokenizer(source, eos)
    ours = ChatTemplate(source, {"bos_token": "<|begin_of_text|>", "eos_token": eos}, "test")
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == expected
    tools = [{"name": "f", "description": "<é>"}]
    assert ours.render(CONVERSATIONS[0], tools=tools) == hf.apply_chat_template(CONVERSATIONS[0], tools=tools,
                                                                               tokenize=False)


def test_extra_message_fields_reach_the_template_as_in_transformers():
    source = ("{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}"
              "{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]{% endif %}: {{ m.content }}\n"
              "{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": "ann", "extra": None},
                {"role": "assistant", "content": "ok", "thinking": "easy"}]
    hf = hf_tokenizer(source, "<|im_end|>")
    assert ChatTemplate(source).render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert ChatTemplate(source).render(messages) == "user(ann): hi\nassistant[easy]: ok\n"


def test_saved_folder_loads_the_same_template_and_tokens(tmp_path):
    hf = hf_tokenizer(LLAMA3, "<|eot_id|>")
    hf.save_pretrained(tmp_path)  # writes chat_template.jinja and tokenizer_config.json, as on the Hub
    t = load_chat_template(tmp_path)
    assert t.source == LLAMA3 and t.eos_token == "<|eot_id|>" and t.bos_token == "<|begin_of_text|>"
    assert t.render(CONVERSATIONS[2], add_generation_prompt=True) == hf.apply_chat_template(
        CONVERSATIONS[2], tokenize=False, add_generation_prompt=True)


def test_raise_exception_is_a_named_refusal():
    t = ChatTemplate(LLAMA3, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(InputError, match="Conversations start with a user or system message"):
        t.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(InputError, match=r"^f:7: the chat template refused the conversation: Conversations start"):
        tokenize_record(Record("messages", "f:7", messages=({"role": "assistant", "content": "x"},)), str.encode, t)


def test_template_sources_in_a_folder(tmp_path):
    cfg = {"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>", "add_bos_token": True,
           "chat_template": [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(tmp_path)
    assert (t.source, t.eos_token, t.bos_token, t.render([])) == ("D{{ eos_token }}", "</s>", "<s>", "D</s>")
    assert "add_bos_token" not in t.special_tokens
    (tmp_path / "chat_template.jinja").write_text("J")  # the .jinja file wins, as in transformers
    assert load_chat_template(tmp_path).source == "J"
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(InputError, match="does not parse"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "T"}]}))
    with pytest.raises(InputError, match="without a template named 'default'"):
        load_chat_template(tmp_path)


def test_eos_from_generation_config_when_the_tokenizer_config_has_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 7, "content": "<end_of_turn>"}]}))
    t = load_chat_template(tmp_path)
    assert t.origin == "default" and t.eos_token == "<end_of_turn>"


def test_default_template_for_a_folder_without_one(tmp_path):
    t = load_chat_template(tmp_path)  # MiniGPT: config.json and a character tokenizer.json only
    assert (t.source, t.eos_token, t.origin) == (DEFAULT_TEMPLATE, DEFAULT_EOS, "default")
    assert t.render(CONVERSATIONS[2]) == ("System: You answer in French.\nUser: Hi\nAssistant: Bonjour.<|end|>\n"
                                          "User: And 2+2?\nAssistant: Quatre.<|end|>")
    assert t.render(CONVERSATIONS[0], add_generation_prompt=True) == "User: What is 2+2?\nAssistant: "
    assert t.render([], add_generation_prompt=True) == "Assistant: "
    assert default_template("</s>").render(CONVERSATIONS[1]) == "User: Hi\nAssistant:  Hello! <b>é</b> </s>"


def test_default_template_renders_the_same_in_transformers():
    hf = hf_tokenizer(DEFAULT_TEMPLATE, DEFAULT_EOS)
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert default_template().render(messages, gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_render_template_function():
    assert render_template("{{ messages | length }}{{ x }}", [{"role": "user", "content": "a"}], x=5) == "15"


CHAT = CONVERSATIONS[2]


def counted_ids(ex):
    return [t for t in ex.labels if t != IGNORE]


@pytest.mark.parametrize("source, eos", [(CHATML, "<|im_end|>"), (CHATML_GEN, "<|im_end|>"), (LLAMA3, "<|eot_id|>")],
                         ids=["chatml", "chatml-generation-tag", "llama3"])
def test_hf_tokenizer_counts_answer_tokens_plus_one_eos_token(source, eos):
    hf = hf_tokenizer(source, eos)
    template = ChatTemplate(source, {"bos_token": "<|begin_of_text|>", "eos_token": eos})
    encode = plain_encoder(hf)
    ex = tokenize_record(Record("messages", "f:1", messages=CHAT), encode, template)
    eos_id = hf.convert_tokens_to_ids(eos)
    assert encode(eos) == [eos_id]
    assert counted_ids(ex) == encode("Bonjour.") + [eos_id] + encode("Quatre.") + [eos_id]
    # the pieces tokenize as the whole rendered string does with this tokenizer
    assert ex.input_ids == hf.apply_chat_template(list(CHAT), tokenize=True, return_dict=False)
    pc = tokenize_record(Record("prompt-completion", "f:2", prompt="Hi? ", completion="Bonjour."), encode, template)
    assert counted_ids(pc) == encode("Bonjour.") + [eos_id]
    assert plain_encoder(hf.backend_tokenizer)("Hi" + eos) == encode("Hi" + eos)


def test_text_and_prompt_completion_start_with_the_tokenizers_own_bos():
    hf = hf_tokenizer(LLAMA3, "<|eot_id|>")  # skips without transformers
    from tokenizers import processors

    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(  # as Llama's tokenizer.json does
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    assert special_prefix(hf) == [bos] == special_prefix(hf.backend_tokenizer)
    template = ChatTemplate(LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    recs = [Record("prompt-completion", "f:1", prompt="Hi? ", completion="Bonjour."),
            Record("messages", "f:2", messages=tuple(CHAT))]
    (pc, chat), stats = tokenize_records(recs, hf, template, block_size=512)
    assert pc.input_ids[0] == bos and pc.labels[0] == IGNORE and pc.input_ids[1:] == hf.encode(
        "Hi? Bonjour.<|eot_id|>", add_special_tokens=False)
    assert chat.input_ids == hf.apply_chat_template(CHAT, tokenize=True, return_dict=False)  # one BOS, the template's
    assert chat.input_ids.count(bos) == 1 and stats.without_eos == 0
    assert special_prefix(hf_tokenizer(CHATML, "<|im_end|>")) == []


def test_eos_from_config_json_named_through_the_tokenizer_vocabulary(tmp_path):
    """No tokenizer_config.json, no generation_config.json: config.json's eos id, a word of a WordLevel vocabulary."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [], "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "<s>": 1, "</s>": 2, "calm": 3}}}))
    assert load_chat_template(tmp_path).eos_token == "</s>"
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))  # generation_config first
    assert load_chat_template(tmp_path).eos_token == "calm"
