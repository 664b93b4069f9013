"""The startup line's warning: an accelerator on the machine that JAX does not use."""

from lmzoo import sharding


def test_an_unused_gpu_is_named_with_the_install_line(tmp_path, monkeypatch):
    (tmp_path / "nvidia0").touch()
    monkeypatch.setitem(sharding.ACCELERATOR_DEVICE_FILES, "an NVIDIA GPU", str(tmp_path / "nvidia[0-9]*"))
    warning = sharding.unused_accelerator_warning()
    assert warning.startswith("warning: this machine has an NVIDIA GPU") and "requirements-cuda12.txt" in warning


def test_no_warning_without_an_accelerator(tmp_path, monkeypatch):
    for name in list(sharding.ACCELERATOR_DEVICE_FILES):
        monkeypatch.setitem(sharding.ACCELERATOR_DEVICE_FILES, name, str(tmp_path / "absent[0-9]*"))
    assert sharding.unused_accelerator_warning() is None
