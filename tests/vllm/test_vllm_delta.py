"""The vLLM adapter takes no delta patches, and says so (no vLLM server is started).

Runs in the vLLM venv (the adapter imports vLLM); skipped without it like every vLLM test.
The behaviour that follows from the declaration (full rounds for a sink that takes no
patches) is covered on every engine by ``DeltaContractSuite.test_sink_without_patches_gets_full_rounds``.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.vllm.vllm_kit import VLLM_PYTHON

pytestmark = [pytest.mark.processes, pytest.mark.vllm, pytest.mark.timeout(300)]

CHECK = """
from wtcore_delta.receiver import delta_sink_for, sink_accepts_patches
from wtcore_vllm.engine import ModelSink
sink = ModelSink(None)
assert sink_accepts_patches(sink) is False
assert delta_sink_for(sink, sink, None).accepts is False
print("ok")
"""


def test_model_sink_declares_no_patches() -> None:
    out = subprocess.run(
        [str(VLLM_PYTHON), "-c", CHECK], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
