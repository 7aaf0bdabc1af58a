import ctypes
import platform

import pytest

from diffdraft.util import heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_glibc_takes_every_setting_and_again():
    assert heap.keep_freed_memory()
    assert heap.keep_freed_memory()  # a second training run in one process sets the same again


def test_another_c_library_is_left_alone(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert not heap.keep_freed_memory()


def test_a_setting_glibc_refuses_is_reported(monkeypatch):
    class RefusingLibrary:
        @staticmethod
        def mallopt(option, value):
            return 0 if option == heap._M_TOP_PAD else 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: RefusingLibrary())
    assert not heap.keep_freed_memory()
