"""The chat template travels with the run: finetune renders chats with --chat-template (or the base's, or the
default), keeps it as chat_template.jinja, and generate, eval and export use it, so transformers serving the
exported folder renders a conversation as training did."""
import json
import warnings

import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.sft.templates import TEMPLATE_FILE, load_chat_template

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CHATS = [{"messages": [{"role": "user", "content": f"wind {i}?"}, {"role": "assistant", "content": f"force {i % 7}"}]}
         for i in range(30)]
# a ChatML-like template in characters the base knows
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
FLAGS = ["--rank", "2", "--alpha", "4", "--steps", "2", "--batch-size", "4", "--lr", "0.01", "--warmup-steps", "1",
         "--eval-every", "2", "--checkpoint-every", "0", "--base-domain", "none", "--no-progress"]
CHAT = [{"role": "user", "content": "wind 3?"}, {"role": "assistant", "content": "force 3"},
        {"role": "user", "content": "wind 4?"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-template")
    tok = CharTokenizer.train(json.dumps(CHATS) + TEMPLATE + "User: Assistant: <|end|>\n")
    torch.manual_seed(0)
    save_base(MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=48, n_layer=1, n_head=2, d_model=16)), tok,
              root / "base")
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS), encoding="utf-8")
    (root / "chatml.jinja").write_text(TEMPLATE, encoding="utf-8")
    return root


def auto_tokenizer(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(folder)


def eval_loss(cli, root, *extra):
    code, out, err = cli("eval", "--base", root / "base", "--data", root / "chats.jsonl", "--json", *extra)
    assert code == 0, err
    return json.loads(out)["loss"]


def test_a_run_keeps_its_template_and_every_command_uses_it(root, tmp_path, cli):
    run = tmp_path / "run"
    code, out, err = cli("finetune", "--base", root / "base", "--data", root / "chats.jsonl", "--out", run,
                         "--chat-template", root / "chatml.jinja", *FLAGS)
    assert code == 0, err
    # MiniGPT's tokenizer names no EOS: the run's copy sets the one its answers ended with
    assert (run / TEMPLATE_FILE).read_text(encoding="utf-8") == '{% set eos_token = "<|end|>" %}' + TEMPLATE
    assert json.loads((run / "manifest.json").read_text())["results"]["sft"]["template"] == str(root / "chatml.jinja")
    # eval and generate with the run's adapter render as training did, unless told otherwise
    with_run = eval_loss(cli, root, "--adapter", run)
    assert with_run == eval_loss(cli, root, "--adapter", run, "--chat-template", root / "chatml.jinja")
    assert with_run == eval_loss(cli, root, "--adapter", run / "adapter_peft")  # the PEFT folder's run's template
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert with_run != eval_loss(cli, root, "--adapter", run, "--chat-template", tmp_path / "plain.jinja")
    code, out, err = cli("generate", "--base", root / "base", "--adapter", run, "--chat", "wind 5?",
                         "--max-new-tokens", "4")
    assert code == 0, err
    # the exported folder carries it: transformers renders a conversation as finetune did
    out_dir = tmp_path / "merged"
    code, _, err = cli("export", "--base", root / "base", "--adapter", run, "--out", out_dir)
    assert code == 0, err
    trained = load_chat_template(root / "base", run / TEMPLATE_FILE)
    rendered = auto_tokenizer(out_dir).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    # (a newline after a block tag is trimmed: transformers' trim_blocks, as ours)
    assert rendered == trained.render(CHAT, True) == "<user>wind 3?<assistant>force 3<|end|><user>wind 4?<assistant>"


@pytest.mark.parametrize("tokenizer_config", [True, False])
def test_a_base_without_a_template_exports_the_default_it_trained_with(hf_folder, tmp_path, tokenizer_config, cli):
    """A llama-family base with no chat template: the run trains the default 'User: ... Assistant: ...</s>' and
    the exported folder, which had no template before, renders it in transformers. Without a tokenizer_config.json
    the EOS comes from config.json's eos_token_id, which transformers' tokenizer does not know: the saved template
    sets it."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(hf_folder("llama"), base)
    if tokenizer_config:
        (base / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "the wind"},
                                                      {"role": "assistant", "content": "is calm"}]}) + "\n"
                             for _ in range(20)), encoding="utf-8")
    run = tmp_path / "run"
    code, _, err = cli("finetune", "--base", base, "--data", chats, "--out", run, "--allow-unknown-chars",
                       *FLAGS)
    assert code == 0, err
    pinned = '{% set eos_token = "</s>" %}'
    assert (run / TEMPLATE_FILE).read_text().startswith(pinned) != tokenizer_config
    out_dir = tmp_path / "merged"
    code, _, err = cli("export", "--base", base, "--adapter", run, "--out", out_dir)
    assert code == 0, err
    chat = [{"role": "user", "content": "the wind"}, {"role": "assistant", "content": "is calm"}]
    rendered = auto_tokenizer(out_dir).apply_chat_template(chat, tokenize=False)
    assert rendered == load_chat_template(base).render(chat) == "User: the wind\nAssistant: is calm</s>"
    if tokenizer_config:  # older transformers read the template from here
        config = json.loads((out_dir / "tokenizer_config.json").read_text())
        assert config["chat_template"] == (out_dir / TEMPLATE_FILE).read_text() and config["eos_token"] == "</s>"


def test_template_mistakes_are_one_line(root, tmp_path, cli):
    (tmp_path / "folder.jinja").mkdir()
    for name, content, message in [("missing.jinja", None, "chat template file not found"),
                                   ("folder.jinja", None, "a folder, not a chat template file"),
                                   ("/dev/null", None, "/dev/null: not a regular file (a device or pipe)"),
                                   ("bad.jinja", "{% for m in messages %}", "the chat template does not parse"),
                                   ("latin1.jinja", "caf\xe9".encode("latin-1"), "not UTF-8")]:
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content)
        code, _, err = cli("finetune", "--base", root / "base", "--data", root / "chats.jsonl", "--out",
                           tmp_path / "run", "--chat-template", path, *FLAGS)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "run").exists()
    (tmp_path / "notes.txt").write_text("wind 3 force 3\n" * 40)
    code, _, err = cli("finetune", "--base", root / "base", "--data", tmp_path / "notes.txt", "--out",
                       tmp_path / "run", "--chat-template", root / "chatml.jinja", *FLAGS)
    assert code == 2 and "--chat-template applies to .jsonl/.json/.parquet/.arrow data" in err
    code, _, err = cli("generate", "--base", root / "base", "--prompt", "wind", "--chat-template",
                       root / "chatml.jinja")
    assert code == 2 and "--system and --chat-template apply to --chat" in err


def test_a_chat_run_evaluates_plain_text_and_its_peft_folder_finds_the_template(root, tmp_path, cli):
    run = tmp_path / "run"
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "chats.jsonl", "--out", run,
                       "--chat-template", root / "chatml.jinja", *FLAGS)
    assert code == 0, err
    (tmp_path / "notes.txt").write_text("wind 3 force 3\n\n" * 30)
    code, out, err = cli("eval", "--base", root / "base", "--adapter", run, "--data", tmp_path / "notes.txt", "--json")
    assert code == 0 and json.loads(out)["tokens"] > 0, err  # forgetting is measured on plain text
    from minituner.sft import trained_template

    assert trained_template(run / "adapter_peft") == trained_template(run / "adapter_final.safetensors") \
        == run / TEMPLATE_FILE
    odd = tmp_path / "odd-run"  # a run whose template is a folder: named, not passed over for the base's
    (odd / "adapter_peft").mkdir(parents=True)
    (odd / "manifest.json").write_text("{}")
    (odd / TEMPLATE_FILE).mkdir()
    for adapter in (odd, odd / "adapter_peft"):
        with pytest.raises(InputError, match="the run's chat template is not a file"):
            trained_template(adapter)
    out_dir = tmp_path / "merged"
    code, _, err = cli("export", "--base", root / "base", "--adapter", run / "adapter_peft", "--out", out_dir)
    assert code == 0, err
    rendered = auto_tokenizer(out_dir).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == load_chat_template(root / "base", run / TEMPLATE_FILE).render(CHAT, True)
    code, _, err = cli("finetune", "--base", root / "base", "--data", root / "chats.jsonl", "--out", run,
                       "--chat-template", run / TEMPLATE_FILE, "--overwrite", *FLAGS)
    assert code == 2 and "reads the run in" in err and (run / TEMPLATE_FILE).is_file()


def test_a_minigpt_base_with_its_own_template_file_exports_what_it_renders(root, tmp_path, cli):
    """A MiniGPT base folder holding a chat_template.jinja (a full fine-tune on chats writes one): the exported
    folder's chat_template.jinja, which transformers reads first, carries it with MiniGPT's EOS set."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(root / "base", base)
    (base / TEMPLATE_FILE).write_text(TEMPLATE)
    run = tmp_path / "run"
    code, _, err = cli("finetune", "--base", base, "--data", root / "chats.jsonl", "--out", run, *FLAGS)
    assert code == 0, err
    out_dir = tmp_path / "merged"
    code, _, err = cli("export", "--base", base, "--adapter", run, "--out", out_dir)
    assert code == 0, err
    rendered = auto_tokenizer(out_dir).apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == load_chat_template(base).render(CHAT, True)
    assert "force 3<|end|>" in rendered


def test_a_hugging_face_folder_that_names_no_eos_renders_it_as_transformers_does(tmp_path):
    """Only a folder without tokenizer metadata (MiniGPT's) gets the default EOS in its template's rendering."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
        "<|im_end|>{% endfor %}")}))
    chat = [{"role": "user", "content": "wind?"}, {"role": "assistant", "content": "calm"}]
    template = load_chat_template(folder)
    assert template.render(chat) == "wind?<|im_end|>calm<|im_end|>" and template.pinned == ()
