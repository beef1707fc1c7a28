"""Tokenized examples count exactly the answers plus EOS; overlong ones are truncated or dropped, and counted;
batches are padded with masked labels, drawn deterministically; evaluation averages over counted tokens."""
import math

import pytest
import torch
import torch.nn.functional as F

from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.sft.batches import ExampleSampler, collate, evaluate_examples, iter_batches
from minituner.sft.examples import IGNORE, SFTConfig, chat_pieces, record_text, tokenize_record, tokenize_records
from minituner.sft.formats import Record
from minituner.sft.templates import DEFAULT_EOS, ChatTemplate, default_template

TOK = CharTokenizer.train("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:?!.,<|>\n+=")
TEMPLATE = default_template()
CHAT = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"})


def counted_ids(ex):
    return [t for t in ex.labels if t != IGNORE]


def test_prompt_completion_counts_completion_plus_eos():
    r = Record("prompt-completion", "f:1", prompt="What is 2+2? ", completion="It is 4.")
    ex = tokenize_record(r, TOK.encode, TEMPLATE)
    assert ex.input_ids == TOK.encode("What is 2+2? It is 4." + DEFAULT_EOS)
    assert counted_ids(ex) == TOK.encode("It is 4.") + TOK.encode(DEFAULT_EOS)
    assert ex.counted == len(TOK.encode("It is 4.")) + len(DEFAULT_EOS)
    full = tokenize_record(r, TOK.encode, TEMPLATE, train_on_inputs=True)
    assert full.input_ids == ex.input_ids and full.labels == [IGNORE] + full.input_ids[1:]


def test_text_counts_everything_but_the_first_token():
    ex = tokenize_record(Record("text", "f:1", text="abc"), TOK.encode, TEMPLATE)
    assert ex.input_ids == TOK.encode("abc<|end|>") and ex.labels == [IGNORE] + ex.input_ids[1:]


def test_chat_counts_each_assistant_turn_plus_eos():
    r = Record("messages", "f:1", messages=CHAT)
    ex = tokenize_record(r, TOK.encode, TEMPLATE)
    assert TOK.decode(ex.input_ids) == TEMPLATE.render(list(CHAT))
    assert counted_ids(ex) == TOK.encode("Hello.<|end|>" + "4<|end|>")
    assert [t for t, answer in chat_pieces(list(CHAT), TEMPLATE) if answer] == ["Hello.<|end|>", "4<|end|>"]
    assert record_text(r, TEMPLATE) == TEMPLATE.render(list(CHAT))


def test_turns_a_template_ends_without_eos_still_count_and_are_reported():
    t = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}", {"eos_token": "<|end|>"})
    (ex,), st = tokenize_records([Record("messages", "f:1", messages=CHAT)], TOK, t, 128)
    assert ex.without_eos and st.without_eos == 1
    assert "1 chats with a turn the template ends without EOS" in st.summary()
    assert counted_ids(ex) == TOK.encode("Hello.\n4\n")
    (ex,), st = tokenize_records([Record("messages", "f:1", messages=CHAT)], TOK, TEMPLATE, 128)
    assert not ex.without_eos and st.without_eos == 0


def test_an_answer_quoting_the_eos_text_counts_whole():
    chat = ({"role": "user", "content": "Say <|end|>"}, {"role": "assistant", "content": "a <|end|> b"})
    ex = tokenize_record(Record("messages", "f:1", messages=chat), TOK.encode, TEMPLATE)
    assert counted_ids(ex) == TOK.encode("a <|end|> b<|end|>")


def test_a_template_whose_answers_cannot_be_located_is_refused():
    # renders only the last message: not prefix by prefix, and an earlier answer appears nowhere
    t = ChatTemplate("{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}", {"eos_token": "."})
    with pytest.raises(InputError, match=r"f:3: the chat template renders this conversation neither prefix by prefix"):
        tokenize_record(Record("messages", "f:3", messages=CHAT), TOK.encode, t)


def test_overlong_examples_are_truncated_or_dropped_and_counted():
    recs = [Record("prompt-completion", f"f:{i}", prompt="p" * n, completion="abc")
            for i, n in enumerate([2, 10, 14, 30], start=1)]
    # lengths: n + 3 + 7 tokens = 12, 20, 24, 40; block_size 19 keeps at most 20 tokens
    ex, st = tokenize_records(recs, TOK, TEMPLATE, block_size=19)
    assert [len(e.input_ids) for e in ex] == [12, 20, 20] and [e.counted for e in ex] == [10, 10, 6]
    assert (st.records, st.examples, st.truncated, st.dropped, st.dropped_empty) == (4, 3, 1, 0, 1)
    assert st.dropped_where == ["f:4"] and st.longest == 40  # truncated to its prompt: nothing left to count
    assert st.tokens == 52 and st.counted_tokens == 26
    assert st.warning(20) == ("warning: 1 examples longer than 20 tokens truncated (their start kept), 1 dropped with "
                              "no trained token inside the window (a prompt that fills it, or a one-token text) "
                              "(first dropped: f:4)")
    ex, st = tokenize_records(recs, TOK, TEMPLATE, block_size=19, cfg=SFTConfig(overlong="drop"))
    assert [len(e.input_ids) for e in ex] == [12, 20] and st.dropped_where == ["f:3", "f:4"]
    assert (st.examples, st.truncated, st.dropped, st.dropped_empty) == (2, 0, 2, 0)
    assert "2 of 4 examples" in st.summary() and "2 dropped" in st.summary()
    assert st.warning(20) == ("warning: 2 examples longer than 20 tokens dropped (--overlong drop) "
                              "(first dropped: f:3, f:4)")
    assert tokenize_records(recs[:1], TOK, TEMPLATE, block_size=19)[1].warning(20) is None
    with pytest.raises(InputError, match="overlong must be one of"):
        tokenize_records(recs, TOK, TEMPLATE, 19, SFTConfig(overlong="wrap"))


def test_collate_pads_right_with_masked_targets():
    ex, _ = tokenize_records([Record("prompt-completion", "f:1", prompt="ab", completion="c"),
                              Record("prompt-completion", "f:2", prompt="a", completion="bcd")], TOK, TEMPLATE, 64)
    x, y = collate(ex, pad_id=0)
    assert x.shape == y.shape == (2, 10)
    assert x[0].tolist() == ex[0].input_ids[:-1] + [0] and y[0].tolist() == ex[0].labels[1:] + [IGNORE]
    assert x[1].tolist() == ex[1].input_ids[:-1] and y[1].tolist() == ex[1].labels[1:]
    assert int((y != IGNORE).sum()) == sum(e.counted for e in ex) == (1 + 7) + (3 + 7)
    assert collate(ex, length=16)[0].shape == (2, 16)
    with pytest.raises(InputError, match="needs 10 positions, more than length 4"):
        collate(ex, length=4)  # 10 needed


def test_batches_are_deterministic_from_a_seed():
    recs = [Record("prompt-completion", f"f:{i}", prompt="q" * (i % 5), completion="a" * (1 + i % 3))
            for i in range(23)]
    ex, _ = tokenize_records(recs, TOK, TEMPLATE, 64)

    def run(seed):
        return [(x.tolist(), y.tolist()) for x, y in iter_batches(ex, 4, seed=seed)]

    assert run(3) == run(3) and run(3) != run(4) and len(run(3)) == 6
    assert len(list(iter_batches(ex, 4, seed=3, drop_last=True))) == 5
    in_order = [x for x, _ in iter_batches(ex, 23, seed=None)][0]
    assert in_order.shape[0] == 23
    sampler = ExampleSampler(ex)
    a = sampler(8, torch.Generator().manual_seed(0))
    b = sampler(8, torch.Generator().manual_seed(0))
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and a[0].shape[0] == 8


def test_evaluate_examples_is_the_mean_over_counted_tokens():
    torch.manual_seed(0)
    model = MiniGPT(GPTConfig(vocab_size=TOK.vocab_size, block_size=32, n_layer=1, n_head=2, d_model=16))
    recs = [Record("prompt-completion", f"f:{i}", prompt="abc" * (1 + i % 3), completion="xy" * (1 + i))
            for i in range(5)]
    ex, st = tokenize_records(recs, TOK, TEMPLATE, 32)
    r = evaluate_examples(model, ex, batch_size=2)
    total = n = 0
    with torch.no_grad():
        for e in ex:  # one example at a time, no padding
            x, y = torch.tensor([e.input_ids[:-1]]), torch.tensor([e.labels[1:]])
            total += F.cross_entropy(model(x)[0], y[0], reduction="sum").item()
            n += int((y != IGNORE).sum())
    assert r.tokens == n == st.counted_tokens and r.examples == 5
    assert r.loss == pytest.approx(total / n, rel=1e-5) and r.perplexity == pytest.approx(math.exp(total / n))
    assert set(r.as_dict()) == {"loss", "perplexity", "examples", "tokens"}
    assert model.training  # restored


@pytest.mark.parametrize("generation_blocks", [False, True])
def test_a_turn_of_weight_0_is_not_counted(generation_blocks):
    """axolotl's per-turn weight: an answer of weight 0 is context, not trained on (its tokens stay in the input);
    weight 1 counts as a turn without one. With {% generation %} blocks as without."""
    template = TEMPLATE
    if generation_blocks:
        template = ChatTemplate("{% for m in messages %}{{ m['role'] | capitalize }}: {% if m['role'] == 'assistant' %}"
                                "{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}{% else %}"
                                "{{ m['content'] }}<|end|>{% endif %}\n{% endfor %}"
                                "{% if add_generation_prompt %}Assistant: {% endif %}")
        assert template.marks_answers
    weighted = tuple({**m, "weight": 0} if m["content"] == "Hello." else {**m, "weight": 1} if m["content"] == "4"
                     else m for m in CHAT)
    ex = tokenize_record(Record("messages", "f:1", messages=weighted), TOK.encode, template)
    plain = tokenize_record(Record("messages", "f:1", messages=CHAT), TOK.encode, template)
    assert ex.input_ids == plain.input_ids
    assert counted_ids(ex) == TOK.encode("4<|end|>") and counted_ids(plain) == TOK.encode("Hello.<|end|>4<|end|>")
