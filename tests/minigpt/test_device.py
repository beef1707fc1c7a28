"""Device selection and the precision check; the CUDA paths run only where a GPU is present."""
from __future__ import annotations

import pytest
import torch

from minigpt.data import forecast_documents
from minigpt.device import check_precision, resolve_device
from minigpt.errors import InputError
from minigpt.model import GPTConfig, MiniGPT
from minigpt.tokenizer import CharTokenizer
from minigpt.train import TrainConfig, train

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    with pytest.raises(InputError, match="device must be one of"):
        resolve_device("tpu")


@pytest.mark.skipif(CUDA, reason="checks the error raised without a GPU")
def test_cuda_without_a_gpu_is_a_one_line_error():
    with pytest.raises(InputError, match="no CUDA device"):
        resolve_device("cuda")


def test_precision_names_and_the_cpu_bf16_check():
    with pytest.raises(InputError, match="precision must be one of fp32, bf16"):
        check_precision("fp8", torch.device("cpu"))
    with pytest.raises(InputError, match="precision must be one of fp32, bf16"):
        check_precision("bf16-autocast", torch.device("cpu"))  # the CLI's old name, not a precision
    assert check_precision("fp32", torch.device("cpu")) is None
    with pytest.raises(InputError, match="no bf16 units.*--precision fp32.*--allow-slow-bf16"):
        check_precision("bf16", torch.device("cpu"), flags={"avx2", "avx512f"})
    assert not check_precision("bf16", torch.device("cpu"), allow_slow_bf16=True, flags={"avx2"}).fast
    assert check_precision("bf16", torch.device("cpu"), flags={"amx_bf16"}).fast


def test_train_refuses_bf16_on_a_model_not_built_for_it():
    with pytest.raises(InputError, match="needs a model built for bf16 compute"):
        tiny_train(torch.device("cpu"), "bf16")


def tiny_train(device: torch.device, precision: str):
    text = "\n\n".join(forecast_documents(40))
    tok = CharTokenizer.train(text)
    ids = torch.tensor(tok.encode(text))
    model = MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, d_model=16)).to(device)
    cfg = TrainConfig(steps=3, batch_size=4, warmup_steps=1, eval_every=3, eval_batches=2, precision=precision)
    return model, train(model, ids, ids, cfg, progress=False)


@needs_cuda
def test_train_on_cuda():
    model, result = tiny_train(resolve_device("cuda"), "fp32")
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())  # weights stay fp32
    assert result.final_train_loss == result.final_train_loss and result.final_val_loss < 10
