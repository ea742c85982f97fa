"""The allocator-snapshot reader (``analysis.snapshot``) on a synthetic snapshot (no torch, no GPU): the peak
counts blocks allocated before recording, its time and live set come from the trace, groups are ordered by total
bytes, origins prefer this repository's frames, and the CLI refuses a file that is not a snapshot in one line.
One test reads the committed 2.7B train-step snapshot when it is there."""

from __future__ import annotations

import gzip
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.snapshot import (BEFORE_RECORDING, WITHOUT_PYTHON, Allocation, load_snapshot, main, markdown,
                               origin, peak_allocations)

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "results/profiles/single_gpu/memory_2.7B_512_fp32_train_step.pickle.gz"
MiB = 2**20
SITE = "/opt/venv/lib/python3.12/site-packages"
TORCH_FRAME = {"filename": f"{SITE}/torch/nn/functional.py", "line": 2000, "name": "linear"}
MODULE_FRAME = {"filename": f"{SITE}/torch/nn/modules/module.py", "line": 1790, "name": "_call_impl"}
REPO_FRAMES = [TORCH_FRAME, {"filename": "/work/main/torch_impl/model.py", "line": 60, "name": "forward"},
               MODULE_FRAME, {"filename": "/work/main/torch_impl/bench/e2e.py", "line": 170, "name": "run"}]
SCRIPT_FRAMES = [TORCH_FRAME, {"filename": "/home/me/train.py", "line": 5, "name": "main"}]
ANALYSIS_FRAMES = [{"filename": "/work/main/analysis/harness.py", "line": 7, "name": "loss"}, MODULE_FRAME]
A, B, C, D, E, F, H, I = (0x7F0000000000 + k * 0x10000000 for k in range(8))  # addresses


def _event(action: str, addr: int, size: int, time_us: int, frames: list[dict] | None = None) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            "frames": frames or [], "compile_context": "N/A", "user_metadata": ""}


def _free(addr: int, size: int, time_us: int) -> list[dict]:
    return [_event("free_requested", addr, size, time_us), _event("free_completed", addr, size, time_us + 1)]


def _block(addr: int, size: int, state: str = "active_allocated", frames: list[dict] | None = None) -> dict:
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames or []}


def _snapshot() -> dict:
    """A (8 MiB) and E (5 MiB) were allocated before recording: A is still held at the dump, the trace frees E.
    The peak, 18 MiB + 512 bytes, is reached by D's allocation at time 50; F (6 MiB) comes after E and D are freed."""
    trace = [_event("segment_alloc", 0x1, 64 * MiB, 5),
             _event("alloc", B, MiB, 10, REPO_FRAMES), _event("alloc", C, MiB, 20, REPO_FRAMES),
             _event("alloc", H, 4, 30, ANALYSIS_FRAMES),  # counted as one 512-byte block, as the allocator does
             _event("alloc", I, MiB, 40, REPO_FRAMES), _event("alloc", D, 2 * MiB, 50, SCRIPT_FRAMES),
             *_free(D, 2 * MiB, 60), *_free(E, 5 * MiB, 70),
             _event("alloc", F, 6 * MiB, 80, REPO_FRAMES), *_free(C, MiB, 90)]
    blocks = [_block(A, 8 * MiB), _block(B, MiB, frames=REPO_FRAMES), _block(I, MiB, frames=REPO_FRAMES),
              _block(H, 512, frames=ANALYSIS_FRAMES), _block(F, 6 * MiB, frames=REPO_FRAMES),
              _block(C, 9 * MiB, state="inactive")]
    segment = {"device": 0, "address": A, "total_size": 64 * MiB, "allocated_size": 16 * MiB + 512,
               "stream": 0, "segment_type": "large", "frames": [], "blocks": blocks}
    return {"segments": [segment], "device_traces": [trace], "allocator_settings": {}, "external_annotations": []}


@pytest.fixture(params=["plain", "gzipped"])
def snapshot_file(request, tmp_path) -> Path:
    data = pickle.dumps(_snapshot())
    path = tmp_path / ("snapshot.pickle" + (".gz" if request.param == "gzipped" else ""))
    path.write_bytes(gzip.compress(data) if request.param == "gzipped" else data)
    return path


def test_peak_counts_preexisting_blocks_and_groups_by_total(snapshot_file):
    snapshot = load_snapshot(snapshot_file)
    assert snapshot == _snapshot()
    peak = peak_allocations(snapshot)
    assert peak.peak_bytes == 18 * MiB + 512
    assert peak.time_us == 50
    assert peak.largest == (Allocation(8 * MiB, BEFORE_RECORDING, 1), Allocation(5 * MiB, BEFORE_RECORDING, 1),
                            Allocation(MiB, "torch_impl/model.py:60 (forward)", 3),  # 3 MiB in all: before D's 2
                            Allocation(2 * MiB, "/home/me/train.py:5 (main)", 1),
                            Allocation(512, "analysis/harness.py:7 (loss)", 1))
    assert peak_allocations(snapshot, top=2).largest == peak.largest[:2]


def test_peak_before_the_first_event_and_without_a_trace():
    snapshot = {"segments": [{"device": 0, "blocks": [_block(A, 8 * MiB)]}], "device_traces": [[]]}
    assert peak_allocations(snapshot) == peak_allocations({**snapshot, "device_traces": []})
    peak = peak_allocations(snapshot)
    assert (peak.peak_bytes, peak.time_us, peak.largest) == (8 * MiB, None, (Allocation(8 * MiB, BEFORE_RECORDING, 1),))
    freeing = {**snapshot, "device_traces": [[*_free(A, 8 * MiB, 10), _event("alloc", B, MiB, 20, REPO_FRAMES)]]}
    assert peak_allocations(freeing).peak_bytes == 8 * MiB and peak_allocations(freeing).time_us == 10
    # recorded without Python frames (the autograd engine's C++ thread): not confused with older blocks
    engine = {**snapshot, "device_traces": [[_event("alloc", B, 16 * MiB, 20)]]}
    assert peak_allocations(engine).largest == (Allocation(16 * MiB, WITHOUT_PYTHON, 1),
                                                Allocation(8 * MiB, BEFORE_RECORDING, 1))
    with pytest.raises(ValueError, match="device 1"):
        peak_allocations(snapshot, device=1)


def test_origin_prefers_this_repository_then_code_outside_torch():
    assert origin(REPO_FRAMES) == "torch_impl/model.py:60 (forward)"
    assert origin(SCRIPT_FRAMES) == "/home/me/train.py:5 (main)"
    assert origin([]) == BEFORE_RECORDING
    assert origin([TORCH_FRAME, MODULE_FRAME]) == "torch/nn/functional.py:2000 (linear)"  # only torch: innermost
    inductor = {"filename": f"{SITE}/torch/_inductor/analysis/profile.py", "line": 3, "name": "f"}
    numpy = {"filename": "/opt/torch/.venv/lib/python3.12/site-packages/numpy/core.py", "line": 9, "name": "g"}
    assert origin([inductor, numpy]) == "numpy/core.py:9 (g)"  # torch's own 'analysis' folder is not ours


def test_markdown_states_the_peak_and_lists_the_groups(snapshot_file):
    text = markdown(peak_allocations(load_snapshot(snapshot_file), top=3), "train step")
    assert text.startswith("### train step\n") and "0.02 GiB" in text
    assert "| 1.0 | 3 | 3.0 | `torch_impl/model.py:60 (forward)` |" in text
    assert len([line for line in text.splitlines() if line.startswith("| ")]) == 1 + 3  # header and 3 groups


def test_cli_prints_the_table_and_refuses_other_files_in_one_line(snapshot_file, tmp_path, capsys):
    assert main([str(snapshot_file), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert f"### {snapshot_file.name}" in out and out.count(BEFORE_RECORDING) == 2
    (tmp_path / "notes.txt").write_text("not a pickle\n")
    (tmp_path / "list.pickle.gz").write_bytes(gzip.compress(pickle.dumps([1, 2, 3])))
    (tmp_path / "corrupt.pickle.gz").write_bytes(gzip.compress(pickle.dumps(_snapshot()))[:20] + b"garbage" * 9)
    for name in ("missing.pickle", "notes.txt", "list.pickle.gz", "corrupt.pickle.gz"):
        bad = tmp_path / name
        with pytest.raises(SystemExit) as exit_info:
            main([str(bad)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1
        assert err.startswith("python -m analysis.snapshot: error: ") and bad.name in err


def test_refuses_pickles_that_name_classes(tmp_path):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Path("/")}))
    with pytest.raises(ValueError, match="not a CUDA memory snapshot"):
        load_snapshot(path)


def test_module_does_not_import_torch():
    code = "import sys, analysis.snapshot; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


@pytest.mark.skipif(not REAL.exists(), reason=f"{REAL.name} not in results/")
def test_real_train_step_snapshot():
    peak = peak_allocations(load_snapshot(REAL))
    assert 10 * 2**30 < peak.peak_bytes < 80 * 2**30
    assert peak.time_us is not None and peak.largest
    assert isinstance(peak.largest[0].origin, str) and peak.largest[0].origin
