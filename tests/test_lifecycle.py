"""Shutdown with copies in flight, interpreter exit, and fork after import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

ENGINE_WITH_WORK = textwrap.dedent(
    """
    import struct, sys, time
    import torch
    from kvoffload._native import TransferEngine

    kv = torch.randn(64, 4096)
    es = kv.element_size()
    engine = TransferEngine(
        [(kv.data_ptr(), 64, 4096 * es, 4096 * es)], 64, [kv], faults=FAULTS
    )
    ids = lambda xs: struct.pack(f"<{len(xs)}I", *xs)
    for i in range(40):
        engine.submit(i + 1, True, ids([i % 64]), ids([i % 64]))
    """
)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_shutdown_with_copies_in_flight_is_bounded_and_reports_them() -> None:
    code = ENGINE_WITH_WORK.replace("FAULTS", '"delay_ms=20"') + textwrap.dedent(
        """
        # Raises if the copy thread does not stop within the bound.
        engine.shutdown(5.0)
        done = engine.poll()
        # Every copy is reported exactly once: run to completion, or failed as shut down.
        assert sorted(t for t, _, _ in done) == list(range(1, 41)), done
        assert all(ok or "shut down" in err for _, ok, err in done), done
        print("OK")
        """
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK")


def test_interpreter_exit_with_copies_in_flight_does_not_crash_or_hang() -> None:
    code = ENGINE_WITH_WORK.replace("FAULTS", '"delay_ms=20"') + "sys.exit(0)\n"
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_after_import_and_engine_start_does_not_deadlock_the_child() -> None:
    code = ENGINE_WITH_WORK.replace("FAULTS", "None") + textwrap.dedent(
        """
        import os
        from kvoffload import parse_config
        from kvoffload._native import Planner
        pid = os.fork()
        if pid == 0:
            # The child gets no copy thread; everything it builds anew must work.
            parse_config({"cpu_bytes_to_use": 1 << 20}, 1)
            p = Planner(16, 8)
            p.lookup("a", [b"x" * 32], 17, 0)
            kv2 = torch.zeros(8, 256)
            e2 = TransferEngine([(kv2.data_ptr(), 8, 1024, 1024)], 4, [kv2])
            e2.submit(1, True, ids([1]), ids([2]))
            assert e2.wait_for([1], 10.0) == [(1, True, None)]
            e2.shutdown()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        engine.shutdown()
        print("CHILD", os.waitstatus_to_exitcode(status))
        """
    )
    proc = run_python(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHILD 0" in proc.stdout
