import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def tiny_cfg():
    from minigpt.model import GPTConfig

    return GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, d_model=16)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and do not fight other test processes for the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
