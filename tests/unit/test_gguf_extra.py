"""A .gguf without the gguf extra installed is refused naming the extra, before any conversion (issue 37)."""

from __future__ import annotations

import pytest

from splitserve.gguf import GGUF_EXTRA_MODULES, GgufExtraMissingError, check_gguf_extra


def test_the_missing_packages_and_the_extra_are_named():
    with pytest.raises(GgufExtraMissingError, match=r'needs accelerate, which is not installed: '
                                                    r'pip install "splitserve\[gguf\]"') as err:
        check_gguf_extra(lambda name: None if name == "accelerate" else object())
    assert err.value.name == "accelerate"
    with pytest.raises(ModuleNotFoundError, match="needs gguf and accelerate, which are not installed"):
        check_gguf_extra(lambda name: None)


def test_installed_packages_pass():
    assert set(GGUF_EXTRA_MODULES) == {"gguf", "accelerate"}
    check_gguf_extra(lambda name: object())
    check_gguf_extra()  # this environment has the extra (make setup installs .[dev])
