"""Instruction data against the reference tools on realistic tokenizers (no downloads: BPE tokenizers trained here
with `tokenizers`, the byte-level kind of Llama 3 and Qwen2 and the SentencePiece kind of Llama 2, Mistral and
TinyLlama, old and new): ids equal transformers' apply_chat_template(tokenize=True), the counted tokens equal its
{% generation %} assistant mask (what TRL's assistant_only_loss trains), a turn ends at its own end-of-turn token
even where that is not the EOS, TRL's conversational prompt-completion counts its completion alone, and
`generate --chat` stops at the end of the turn."""
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from minituner.sft.chat import answer, chat_prompt  # noqa: E402
from minituner.sft.examples import IGNORE, SFTConfig, tokenize_records  # noqa: E402
from minituner.sft.files import read_file  # noqa: E402
from minituner.sft.formats import Record  # noqa: E402
from minituner.sft.templates import load_chat_template  # noqa: E402
from minituner.tokenizer_files import load_tokenizer  # noqa: E402

CORPUS = ["Hello! How are you today? I am fine, thank you.", "What is the weather in Bergen?",
          "The wind is south-west 7 to 8, rain, 12 C.", "You are a helpful assistant.", "Bonjour. Quatre.",
          "And 2+2?\n\nIt is 4.\n", "line one\nline two\n\nline three\n\n\n", "café naïve 日本語",
          "[INST] hi [/INST] Hello", "Sure!\n```python\nprint('hi')\n```\n"] * 20
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")  # Llama 3's pre-tokenizer pattern
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHATML_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                   "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                   "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
                    "{% endfor %}")
ZEPHYR_TEMPLATE = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
                   "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
                   "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
                   "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                  "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}"
                  "{% set role = message['role'] %}{% endif %}"
                  "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
# Llama 3's, with the trained span (content and <|eot_id|>) in {% generation %}
LLAMA3_GENERATION = ("{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
                     "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
                     "{% if message['role'] == 'assistant' %}{% generation %}"
                     "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
                     "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
                     "{% endif %}")

CHATS = [
    [{"role": "user", "content": "What is the weather in Bergen?"},
     {"role": "assistant", "content": "The wind is south-west 7 to 8, rain, 12 C."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour."},
     {"role": "user", "content": "And 2+2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "user", "content": "café?"}, {"role": "assistant", "content": "naïve 日本語"}],
    [{"role": "user", "content": "Code?"}, {"role": "assistant", "content": "Sure!\n```python\nprint('hi')\n```\n"}],
]


def byte_level(specials, bos=None):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    post = [processors.ByteLevel(trim_offsets=False)]
    if bos:  # Llama 3: the post-processor puts <|begin_of_text|> before text
        post.append(processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]))
    tok.post_processor = processors.Sequence(post)
    return tok


def sentencepiece_like(legacy: bool):
    """Llama 2 / Mistral: BPE with byte fallback and ▁ for spaces; legacy: the old Prepend + Replace normalizer,
    else the Metaspace pre-tokenizer; BOS from the post-processor."""
    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    alphabet = sorted(set("".join(CORPUS).replace(" ", "▁")) | {"▁"})
    tok.train_from_iterator(["▁" + c.replace(" ", "▁") for c in CORPUS],
                            trainers.BpeTrainer(vocab_size=500, special_tokens=specials, initial_alphabet=alphabet))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def folder_with(tmp_path, name, tok, template, bos, eos, **files):
    folder = tmp_path / name
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "clean_up_tokenization_spaces": False, **({"bos_token": bos} if bos else {}),
              **({"eos_token": eos} if eos else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for file, content in files.items():
        (folder / file).write_text(json.dumps(content))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours, _ = load_tokenizer(folder, 10**6)
    return hf, ours, load_chat_template(folder)


def example(chat_or_record, ours, template, **cfg):
    record = chat_or_record if isinstance(chat_or_record, Record) else Record("messages", "x:1",
                                                                              messages=tuple(chat_or_record))
    (ex,), stats = tokenize_records([record], ours, template, 10_000, SFTConfig(**cfg))
    return ex, stats


def counted_text(hf, ex) -> str:
    return hf.decode([t for t in ex.labels if t != IGNORE])


FAMILIES = {  # name: (tokenizer, template, bos, eos, the text each CHATS[1] answer counts)
    "mistral-v0.1, SentencePiece (legacy)": (lambda: sentencepiece_like(True), MISTRAL_TEMPLATE, "<s>", "</s>",
                                             "Bonjour.</s>It is 4.</s>"),
    "mistral-v0.1, SentencePiece (Metaspace)": (lambda: sentencepiece_like(False), MISTRAL_TEMPLATE, "<s>", "</s>",
                                                "Bonjour.</s>It is 4.</s>"),
    "zephyr / tinyllama": (lambda: sentencepiece_like(True), ZEPHYR_TEMPLATE, "<s>", "</s>",
                           "Bonjour.</s>It is 4.</s>"),
    "qwen2.5 base, eos <|endoftext|>": (lambda: byte_level(CHATML), CHATML_TEMPLATE, None, "<|endoftext|>",
                                        "Bonjour.<|im_end|>It is 4.<|im_end|>"),
    "gemma-it, eos <eos>": (lambda: byte_level(GEMMA, bos="<bos>"), GEMMA_TEMPLATE, "<bos>", "<eos>",
                            "Bonjour.<end_of_turn>It is 4.<end_of_turn>"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_are_apply_chat_templates_and_each_turn_counts_to_its_end_token(tmp_path, family):
    factory, template, bos, eos, counted = FAMILIES[family]
    hf, ours, chat_template = folder_with(tmp_path, "base", factory(), template, bos, eos)
    for chat in CHATS:
        ex, stats = example(chat, ours, chat_template)
        assert ex.input_ids == hf.apply_chat_template(chat, tokenize=True, return_dict=False), chat
        assert stats.without_eos == 0
    ex, _ = example(CHATS[1], ours, chat_template)
    assert counted_text(hf, ex) == counted  # no "▁" before an answer, no newline after its end-of-turn token


def test_generation_blocks_give_transformers_assistant_mask(tmp_path):
    hf, ours, template = folder_with(tmp_path, "base", byte_level(LLAMA3, bos="<|begin_of_text|>"),
                                     LLAMA3_GENERATION, "<|begin_of_text|>", "<|eot_id|>")
    assert template.marks_answers
    for chat in CHATS:
        ref = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ex, _ = example(chat, ours, template)
        assert ex.input_ids == ref["input_ids"]
        assert [int(t != IGNORE) for t in ex.labels] == ref["assistant_masks"]


def test_text_and_completions_start_with_bos_and_end_with_one_eos(tmp_path):
    """The BOS the tokenizer's post-processor writes (minituner's own HFTokenizer too), as TRL's tokenizer(text);
    an EOS already at the end is not doubled, nor a BOS already at the start (text a chat template rendered)."""
    hf, ours, template = folder_with(tmp_path, "base", byte_level(LLAMA3, bos="<|begin_of_text|>"),
                                     LLAMA3_GENERATION, "<|begin_of_text|>", "<|eot_id|>")
    bos = "<|begin_of_text|>"
    for text in ("Bonjour.", "Bonjour.<|eot_id|>", f"{bos}Bonjour.", f"{bos}Bonjour.<|eot_id|>"):
        ex, _ = example(Record("text", "x:1", text=text), ours, template)  # one BOS and one EOS, whatever the text
        assert ex.input_ids == hf("Bonjour.<|eot_id|>")["input_ids"]
        assert hf.convert_ids_to_tokens(ex.input_ids)[0] == "<|begin_of_text|>" and ex.labels[0] == IGNORE
    ex, _ = example(Record("prompt-completion", "x:1", prompt="What is the weather in Bergen? ",
                           completion="The wind is south-west 7 to 8."), ours, template)
    assert ex.input_ids == hf("What is the weather in Bergen? The wind is south-west 7 to 8.<|eot_id|>")["input_ids"]
    assert counted_text(hf, ex).strip() == "The wind is south-west 7 to 8.<|eot_id|>"


def test_conversational_prompt_completion_counts_the_completion_alone(tmp_path):
    """TRL's conversational prompt-completion: an assistant turn inside the prompt is context."""
    hf, ours, template = folder_with(tmp_path, "base", byte_level(CHATML), CHATML_TEMPLATE, None, "<|im_end|>")
    path = tmp_path / "pc.jsonl"
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour."},
              {"role": "user", "content": "And 2+2?"}]
    path.write_text(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": "Quatre."}]}))
    (record,) = read_file(path)
    ex, _ = example(record, ours, template)
    assert counted_text(hf, ex) == "Quatre.<|im_end|>"


def test_special_tokens_map_names_the_tokens_as_in_transformers(tmp_path):
    """Older folders keep bos and eos in special_tokens_map.json; it takes precedence, as in transformers."""
    hf, ours, template = folder_with(tmp_path, "base", sentencepiece_like(False), MISTRAL_TEMPLATE, None, None,
                                     **{"special_tokens_map.json": {"bos_token": "<s>", "eos_token": "</s>"}})
    assert (template.bos_token, template.eos_token) == (hf.bos_token, hf.eos_token) == ("<s>", "</s>")
    assert template.render(CHATS[0]) == hf.apply_chat_template(CHATS[0], tokenize=False)


class Replay(torch.nn.Module):
    """Stands in for a model: 'samples' a fixed continuation, stopping at the first of the stop ids it is given."""

    def __init__(self, continuation):
        super().__init__()
        self.w, self.continuation, self.stops = torch.nn.Parameter(torch.zeros(1)), continuation, None

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None, eos_id=None):
        self.stops = eos_id
        out = []
        for t in self.continuation[:max_new_tokens]:
            out.append(t)
            if t in (eos_id or []):
                break
        return torch.cat([idx, torch.tensor([out])], 1)


@pytest.mark.parametrize("family", ["qwen2.5 base, eos <|endoftext|>", "gemma-it, eos <eos>"])
def test_a_chat_answer_stops_at_its_turns_end_token(tmp_path, family):
    factory, template, bos, eos, _ = FAMILIES[family]
    hf, ours, chat_template = folder_with(tmp_path, "base", factory(), template, bos, eos)
    question = [{"role": "user", "content": "Hi"}]
    assert chat_prompt(chat_template, "Hi") == hf.apply_chat_template(question, tokenize=False,
                                                                      add_generation_prompt=True)
    end = "<|im_end|>" if "qwen" in family else "<end_of_turn>"
    model = Replay(ours.encode(f"Hello!{end}\nuser\nHi"))
    assert answer(model, ours, chat_template, "Hi") == "Hello!"
    assert hf.convert_tokens_to_ids(end) in model.stops


# Qwen3's way: an assistant turn before the last question drops its thinking, so earlier turns change as the
# conversation grows and prefixes do not render alike
THINKING_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                     "{{ '<|im_start|>assistant\n' }}{% if loop.last %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
                     "{{ message['content'] + '<|im_end|>\n' }}{% else %}"
                     "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_located_by_a_marker(tmp_path):
    hf, ours, template = folder_with(tmp_path, "base", byte_level(CHATML + ["<think>", "</think>"]),
                                     THINKING_TEMPLATE, None, "<|im_end|>")
    ex, stats = example(CHATS[1], ours, template)
    assert ex.input_ids == hf.apply_chat_template(CHATS[1], tokenize=True, return_dict=False)
    # the answer starts where the generation prompt ends: the last turn's thinking block is the model's to write
    assert counted_text(hf, ex) == "Bonjour.<|im_end|><think>\n\n</think>\n\nIt is 4.<|im_end|>"
    assert stats.without_eos == 0
    # a template that shows an answer twice places it nowhere: refused, named
    twice = THINKING_TEMPLATE.replace("{{ message['content'] + '<|im_end|>\n' }}",
                                      "{{ message['content'] + message['content'] + '<|im_end|>\n' }}")
    _, ours, template = folder_with(tmp_path, "twice", byte_level(CHATML), twice, None, "<|im_end|>")
    with pytest.raises(Exception, match="x:1: the chat template renders this conversation neither prefix by prefix"):
        example(CHATS[1], ours, template)
