"""bf16 capability: detected from CPU flags (mocked both ways), refused in one line unless the user insists."""
import pytest
import torch

from minigpt import bf16_support as bs
from minigpt.errors import InputError

X86_OLD = "processor\t: 0\nmodel name\t: Old Xeon\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl\n"
X86_BF16 = X86_OLD.replace("avx512vl", "avx512vl avx512_bf16")
X86_AMX = X86_OLD.replace("avx512vl", "avx512vl avx512_bf16 amx_bf16 amx_tile")
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("text, units", [(X86_OLD, ()), (X86_BF16, ("avx512_bf16",)),
                                         (X86_AMX, ("amx_bf16", "avx512_bf16")), (ARM_BF16, ("bf16",)), ("", ())])
def test_units_from_cpuinfo(text, units):
    assert bs.cpu_bf16_units(bs.parse_cpu_flags(text)) == units


def test_cpu_with_units_is_fast_and_passes_the_check():
    s = bs.check_bf16("cpu", flags=bs.parse_cpu_flags(X86_BF16))
    assert s.fast and s.units == ("avx512_bf16",) and "avx512_bf16" in s.reason


def test_cpu_without_units_is_refused_in_one_line():
    with pytest.raises(InputError) as e:
        bs.check_bf16("cpu", flags=bs.parse_cpu_flags(X86_OLD))
    msg = str(e.value)
    assert "\n" not in msg and "no bf16 units" in msg and "--precision fp32" in msg and "--allow-slow-bf16" in msg


def test_the_user_may_insist():
    s = bs.check_bf16("cpu", allow_slow_bf16=True, flags=())
    assert not s.fast and s.units == ()


def test_this_machine_reads_proc_cpuinfo(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(X86_AMX)
    monkeypatch.setattr(bs, "CPUINFO", fake)
    assert bs.bf16_support("cpu").units == ("amx_bf16", "avx512_bf16")
    fake.unlink()
    assert bs.bf16_support("cpu").units == ("amx_bf16", "avx512_bf16")  # read once per process, not per call
    old = tmp_path / "cpuinfo_old"  # read once per process (a CPU's flags do not change): another file, not new text
    old.write_text(X86_OLD)
    monkeypatch.setattr(bs, "CPUINFO", old)
    assert not bs.bf16_support("cpu").fast
    monkeypatch.setattr(bs, "CPUINFO", tmp_path / "missing")
    assert bs.cpu_flags() == frozenset() and not bs.bf16_support("cpu").fast


def test_cuda_is_decided_by_the_gpu():
    assert bs.check_bf16("cuda", cuda_bf16=True).fast
    with pytest.raises(InputError, match="this GPU does not support bf16; .*use --precision fp32$"):
        bs.check_bf16("cuda", cuda_bf16=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_on_this_machine():
    assert bs.bf16_support("cuda").fast == torch.cuda.is_bf16_supported()
