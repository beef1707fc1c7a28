"""The contract with minigpt.train: batches from ExampleSampler go through lm_loss unchanged, the loss is the
mean over counted tokens, a short run lowers the answer loss, and chat answers are cut at EOS."""
import torch

from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minigpt.train import lm_loss
from minituner.sft import (ExampleSampler, answer, chat_prompt, collate, cut_answer, default_template,
                           evaluate_examples, examples_sha256, forecast_qa, record_text, split_records,
                           tokenize_records)

TEMPLATE = default_template()


def setup(n=240):
    records = forecast_qa(n)
    tok = CharTokenizer.train("".join(record_text(r, TEMPLATE) for r in records))
    splits = split_records(records)
    train, _ = tokenize_records(splits["train"], tok, TEMPLATE, 128)
    val, _ = tokenize_records(splits["val"], tok, TEMPLATE, 128)
    return tok, train, val, splits["val"]


def tiny(vocab):
    torch.manual_seed(0)
    return MiniGPT(GPTConfig(vocab_size=vocab, block_size=128, n_layer=1, n_head=2, d_model=16))


def test_lm_loss_on_a_batch_is_the_mean_over_counted_tokens():
    tok, train, _, _ = setup(40)
    model = tiny(tok.vocab_size)
    x, y = collate(train[:8])
    with torch.no_grad():
        assert torch.isclose(lm_loss(model, x, y), torch.tensor(evaluate_examples(model, train[:8], 8).loss), rtol=1e-5)
    assert examples_sha256(train) == examples_sha256(list(train)) != examples_sha256(train[1:])


def test_a_short_run_lowers_the_answer_loss_and_answers_stop_at_eos():
    tok, train, val, val_records = setup()
    model = tiny(tok.vocab_size)
    before = evaluate_examples(model, val).loss
    sampler, gen = ExampleSampler(train), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    for _ in range(15):
        x, y = sampler(8, gen)
        loss = lm_loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate_examples(model, val)
    assert after.loss < before - 1.0 and after.examples == len(val)
    question = val_records[0].messages[0]["content"]  # a bulletin the run never saw
    assert chat_prompt(TEMPLATE, question) == f"User: {question}\nAssistant: "
    reply = answer(model, tok, TEMPLATE, question, max_new_tokens=20)
    assert "<|end|>" not in reply and reply == answer(model, tok, TEMPLATE, question, max_new_tokens=20)
    assert cut_answer("7 to 8<|end|>\nUser:", TEMPLATE) == "7 to 8" and cut_answer("abc", TEMPLATE) == "abc"
