"""run_info (paths, the base's pretraining, samples) and parity (PEFT, bitsandbytes) on a tiny MiniGPT."""
import pytest
import torch

from minigpt.base_folder import save_base
from minigpt.manifest import write_manifest
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minituner.build import build_for_training, wrap_minigpt_qlora
from minituner.lora import LoRAConfig, lora_modules
from minituner.parity import bnb_nf4_max_logit_diff, peft_max_logit_diff
from minituner.peft_format import save_peft_adapter
from minituner.run_info import base_pretrain, display_path, sample_texts

CFG = GPTConfig(vocab_size=12, block_size=8, n_layer=1, n_head=2, d_model=64)


def tiny() -> MiniGPT:
    torch.manual_seed(0)
    return MiniGPT(CFG).eval()


def test_display_path(tmp_path):
    assert display_path(tmp_path / "a" / "b", tmp_path) == "a/b"
    assert display_path(tmp_path, tmp_path / "elsewhere") == str(tmp_path)


def test_base_pretrain_reads_the_manifest(tmp_path):
    save_base(tiny(), None, tmp_path)
    assert base_pretrain(tmp_path) is None
    write_manifest(tmp_path / "manifest.json", seed=0, config={"data": "builtin:x", "train": {"steps": 7}},
                   wall_time_s=0.0, extra={"results": {"final_val_loss": 1.5}})
    assert base_pretrain(tmp_path) == {"steps": 7, "data": "builtin:x", "val_loss": 1.5}


def test_sample_texts_are_seeded():
    tok = CharTokenizer.train("abcdefghij")
    model = MiniGPT(GPTConfig(**{**CFG.to_dict(), "vocab_size": tok.vocab_size})).eval()
    a = sample_texts(model, tok, ("ab", "c"), n_tokens=5)
    assert a == sample_texts(model, tok, ("ab", "c"), n_tokens=5) and a[0].startswith("ab") and a[1].startswith("c")


def test_peft_loads_our_folder_to_the_same_logits(tmp_path):
    pytest.importorskip("peft")
    ours = build_for_training(tiny(), "lora", LoRAConfig(r=4), device="cpu").eval()
    for m in lora_modules(ours).values():
        torch.nn.init.normal_(m.lora_B["default"].weight)  # a non-zero update, so the check sees the adapter
    save_peft_adapter(ours, tmp_path / "p")
    x = torch.randint(CFG.vocab_size, (2, CFG.block_size))
    assert peft_max_logit_diff(tiny(), tmp_path / "p", ours, x) < 1e-5


def test_bitsandbytes_nf4_gives_our_logits():
    pytest.importorskip("bitsandbytes")
    x = torch.randint(CFG.vocab_size, (2, CFG.block_size))
    ours = wrap_minigpt_qlora(tiny(), r=4, device="cpu").eval()
    with torch.no_grad():
        logits = ours(x)
    float_lora = build_for_training(tiny(), "lora", LoRAConfig(r=4), device="cpu").eval()
    diff = bnb_nf4_max_logit_diff(float_lora, x, logits)
    assert diff is not None and diff < 1e-4
