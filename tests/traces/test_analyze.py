"""Layer 1 (CPU): unit tests of traces/ — interval math, the Chrome and Nsight SQLite readers,
comm classification, ubatch attribution, the overlap analyzer and its CLI.

Every expected number below is worked out by hand from the synthetic events (µs).
"""
from __future__ import annotations

import gzip
import json
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from traces.analyze import AnalyzeConfig, analyze, main
from traces.classify import ClassifyConfig, Classifier, Kind, kernel_ubatches
from traces.intervals import Span, clip, intersect, measure, merge, subtract
from traces.model import KernelInterval, Trace, parse_label_name
from traces.readers import ReadConfig, read_chrome_trace, read_nsys_sqlite, read_trace

# ---------------------------------------------------------------- synthetic Chrome events


def kernel(name: str, ts: float, dur: float, *, pid: Any = 0, tid: Any = 7, cat: str = "kernel",
           **args: Any) -> dict[str, Any]:
    """A Kineto-style complete event ('X'); ``args`` go to the event's args."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


def gpu_label(name: str, ts: float, dur: float, *, pid: Any = 0, tid: Any = 7) -> dict[str, Any]:
    return kernel(name, ts, dur, pid=pid, tid=tid, cat="gpu_user_annotation")


def cpu_label(name: str, ts: float, dur: float, *, tid: int = 100) -> dict[str, Any]:
    return kernel(name, ts, dur, pid=4242, tid=tid, cat="user_annotation")


def write_chrome(path: Path, events: list[dict[str, Any]], *, gz: bool = False) -> Path:
    payload = json.dumps({"schemaVersion": 1, "traceEvents": events})
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(payload)
    else:
        path.write_text(payload)
    return path


def one_device(tmp_path: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    report = analyze(read_chrome_trace(write_chrome(tmp_path / "t.json", events)))
    assert list(report.devices) == [0]
    return report.to_json()["devices"]["0"]


# ---------------------------------------------------------------- interval math


def test_merge_and_measure() -> None:
    spans = [Span(5, 15), Span(0, 10), Span(20, 30), Span(30, 31), Span(22, 25), Span(40, 40)]
    assert merge(spans) == [Span(0, 15), Span(20, 31)]
    assert measure(spans) == 26
    assert merge([]) == [] and measure([]) == 0.0


def test_intersect_subtract_clip() -> None:
    a = merge([Span(0, 50), Span(60, 100)])
    b = merge([Span(40, 70), Span(65, 75)])
    assert intersect(a, b) == [Span(40, 50), Span(60, 75)]
    assert subtract(b, a) == [Span(50, 60)]
    assert subtract(a, b) == [Span(0, 40), Span(75, 100)]
    assert clip(a, Span(10, 70)) == [Span(10, 50), Span(60, 70)]


def test_interval_ops_match_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        def rand_spans() -> list[Span]:
            out = []
            for _ in range(rng.randint(0, 6)):
                s = rng.randint(0, 40)
                out.append(Span(s, s + rng.randint(0, 12)))
            return out

        a, b = rand_spans(), rand_spans()
        cells_a = {t for s in a for t in range(int(s.start), int(s.end))}
        cells_b = {t for s in b for t in range(int(s.start), int(s.end))}
        ma, mb = merge(a), merge(b)
        assert measure(a) == len(cells_a)
        assert measure(intersect(ma, mb)) == len(cells_a & cells_b)
        assert measure(subtract(ma, mb)) == len(cells_a - cells_b)
        for out in (intersect(ma, mb), subtract(ma, mb)):
            assert merge(out) == out  # canonical: sorted, disjoint, non-empty


# ---------------------------------------------------------------- labels and classification


def test_parse_label_name() -> None:
    p = parse_label_name("ub0/L3/dispatch_send")
    assert (p.ubatch, p.layer, p.phase) == (0, 3, "dispatch_send")
    p = parse_label_name("ub1/attention")
    assert (p.ubatch, p.layer, p.phase) == (1, None, "attention")
    p = parse_label_name("L2/experts")
    assert (p.ubatch, p.layer, p.phase) == (None, 2, "experts")
    for name in ("ProfilerStep#3", "step/3", "aten::mm", "ub0/L1/a/b"):
        assert parse_label_name(name).phase is None


def test_classifier_defaults_and_extra_patterns() -> None:
    c = Classifier()

    def k(name: str, category: str = "kernel") -> KernelInterval:
        return KernelInterval(device=0, stream=0, name=name, start_us=0, end_us=1, category=category)

    for name in ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "allToAllV_2d",
                 "void deep_ep::intranode::dispatch<8>(...)", "one_shot_all_reduce", "NVSHMEM_put"):
        assert c.kind(k(name)) is Kind.COMM, name
    assert c.kind(k("Memcpy PtoP (Device -> Device)", "memcpy")) is Kind.COMM
    assert c.kind(k("Memcpy HtoD (Pageable -> Device)", "memcpy")) is Kind.COPY
    assert c.kind(k("sm90_xmma_gemm_bf16bf16_bf16f32")) is Kind.COMPUTE
    assert Classifier(ClassifyConfig().with_extra("MyExchange")).kind(k("myexchange_kernel")) is Kind.COMM
    with pytest.raises(ValueError, match="not a valid regex"):
        ClassifyConfig(comm_patterns=("(",))
    with pytest.raises(TypeError, match="tuple of strings"):
        ClassifyConfig(comm_patterns="nccl")  # type: ignore[arg-type]


# ---------------------------------------------------------------- analyzer, Chrome traces


def test_overlapping_kernels_on_one_stream_count_once(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [
        kernel("gemm_a", 0, 10), kernel("gemm_b", 5, 10),  # stream 7: [0, 15)
        kernel("gemm_c", 20, 10, tid=8),                  # stream 8: [20, 30)
    ])
    assert dev["compute_busy_us"] == 25 and dev["wall_us"] == 30
    assert dev["streams"]["7"]["busy_us"] == 15 and dev["streams"]["7"]["num_kernels"] == 2
    assert dev["streams"]["8"]["busy_us"] == 10
    assert dev["comm_us"] == 0 and dev["overlap_fraction"] == 0  # no comm: 0 by definition


def test_comm_fully_hidden(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [kernel("gemm", 0, 100), kernel("ncclKernel_AllToAll", 10, 30, tid=13)])
    assert (dev["comm_us"], dev["comm_overlapped_us"], dev["comm_exposed_us"]) == (30, 30, 0)
    assert dev["overlap_fraction"] == 1.0 and dev["wall_us"] == 100


def test_comm_partly_exposed(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [
        kernel("gemm", 0, 50), kernel("gemm", 60, 40),             # compute [0,50) [60,100)
        kernel("all_to_all_kernel", 40, 30, tid=13),              # comm [40,70)
        kernel("nccl_sendrecv", 65, 10, tid=14),                  # comm [65,75), overlaps the first
    ])
    assert dev["compute_busy_us"] == 90
    assert dev["comm_us"] == 35                # [40, 75)
    assert dev["comm_overlapped_us"] == 25     # [40,50) + [60,75)
    assert dev["comm_exposed_us"] == 10        # [50, 60)
    assert dev["overlap_fraction"] == round(25 / 35, 4)
    assert dev["streams"]["13"]["comm_us"] == 30 and dev["streams"]["13"]["compute_us"] == 0


def test_no_comm_at_all(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [kernel("gemm", 0, 10), kernel("softmax", 30, 10)])
    assert dev["compute_busy_us"] == 20 and dev["wall_us"] == 40
    assert dev["comm_us"] == dev["comm_exposed_us"] == dev["overlap_fraction"] == 0


def test_nested_labels_phase_sums_and_ubatch_attribution(tmp_path: Path) -> None:
    events = [
        gpu_label("ProfilerStep#1", 0, 120),
        gpu_label("ub0/L0/moe", 0, 100),
        gpu_label("ub0/L0/experts", 10, 50),      # nested in ub0/L0/moe
        gpu_label("ub1/L0/experts", 60, 30),      # nested in ub0/L0/moe too
        gpu_label("ub0/L1/experts", 100, 10),
        kernel("gemm", 20, 10), kernel("gemm", 70, 10), kernel("gemm", 95, 2),
    ]
    trace = read_chrome_trace(write_chrome(tmp_path / "t.json", events))
    dev = analyze(trace).to_json()["devices"]["0"]
    assert dev["phases"] == {"ub0": {"experts": 60.0, "moe": 100.0}, "ub1": {"experts": 30.0}}
    assert dev["phase_source"] == "device"
    assert dev["window_source"] == "gpu step labels" and dev["wall_us"] == 120
    assert kernel_ubatches(trace) == [0, 1, 0]


def test_step_window_clips_and_excludes_warmup(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [
        kernel("warmup_gemm", 0, 10),
        gpu_label("ProfilerStep#2", 100, 200),                     # window [100, 300)
        kernel("gemm", 100, 100), kernel("gemm", 150, 110, tid=8),  # compute [100, 260)
        kernel("nccl_all_to_all", 250, 70, tid=13),                # comm [250, 320) -> [250, 300)
    ])
    assert dev["wall_us"] == 200 and dev["compute_busy_us"] == 160
    assert dev["comm_us"] == 50 and dev["comm_overlapped_us"] == 10 and dev["comm_exposed_us"] == 40
    assert dev["streams"]["7"]["num_kernels"] == 1  # the warmup kernel is outside
    whole = analyze(read_chrome_trace(tmp_path / "t.json"), AnalyzeConfig(step_pattern=None))
    assert whole.devices[0].wall_us == 320


def test_cpu_step_window_uses_kernels_launched_inside(tmp_path: Path) -> None:
    dev = one_device(tmp_path, [
        cpu_label("ProfilerStep#0", 50, 40),                                   # CPU [50, 90)
        kernel("cudaLaunchKernel", 10, 2, pid=4242, tid=100, cat="cuda_runtime", correlation=1),
        kernel("cudaLaunchKernel", 60, 2, pid=4242, tid=100, cat="cuda_runtime", correlation=2),
        kernel("cudaLaunchKernel", 70, 2, pid=4242, tid=100, cat="cuda_runtime", correlation=3),
        kernel("gemm", 20, 30, correlation=1),    # launched before the step
        kernel("gemm", 100, 30, correlation=2),
        kernel("gemm", 140, 10, correlation=3),
    ])
    assert dev["window_source"] == "cpu step labels" and dev["wall_us"] == 50  # [100, 150)
    assert dev["compute_busy_us"] == 40


def test_two_devices_with_string_pids_and_tids(tmp_path: Path) -> None:
    events = [
        kernel("gemm", 0, 100, pid="0", tid="stream 7"),
        kernel("ncclKernel", 90, 20, pid="0", tid="stream 20"),
        kernel("gemm", 0, 40, pid="1", tid="stream 7"),
        kernel("ncclKernel", 0, 40, pid="1", tid="stream 21"),
        gpu_label("ub1/L0/attention", 0, 40, pid="1", tid="stream 7"),
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler", "pid": "Spans", "tid": "PyTorch Profiler",
         "ts": 0, "dur": 200},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}},
    ]
    report = analyze(read_chrome_trace(write_chrome(tmp_path / "t.json", events)))
    out = report.to_json()["devices"]
    assert sorted(out) == ["0", "1"]
    assert sorted(out["0"]["streams"]) == ["20", "7"]
    assert (out["0"]["comm_us"], out["0"]["comm_exposed_us"], out["0"]["wall_us"]) == (20, 10, 110)
    assert (out["1"]["comm_us"], out["1"]["comm_exposed_us"], out["1"]["overlap_fraction"]) == (40, 0, 1.0)
    assert out["1"]["phases"] == {"ub1": {"attention": 40.0}} and out["0"]["phase_source"] == "none"


def test_gzip_memcpy_options_and_cpu_only_trace(tmp_path: Path) -> None:
    events = [kernel("gemm", 0, 10), kernel("Memcpy HtoD (Pageable -> Device)", 20, 5, cat="gpu_memcpy"),
              kernel("Memset (Device)", 30, 1, cat="gpu_memset")]
    path = write_chrome(tmp_path / "t.json.gz", events, gz=True)
    dev = analyze(read_trace(path)).to_json()["devices"]["0"]
    assert dev["copy_us"] == 6 and dev["compute_busy_us"] == 10 and dev["num_kernels"] == 3
    trace = read_trace(path, config=ReadConfig(include_memcpy=False, include_memset=False))
    assert [k.name for k in trace.kernels] == ["gemm"]

    cpu = write_chrome(tmp_path / "cpu.json", [
        kernel("aten::mm", 0, 10, pid=77, tid=78, cat="cpu_op"),
        kernel("aten::add", 5, 10, pid=77, tid=78, cat="cpu_op"),
        cpu_label("ub0/L0/experts", 0, 20, tid=78),
    ])
    empty = analyze(read_trace(cpu, config=ReadConfig(cpu_ops_as_kernels=False)))
    assert empty.devices == {} and any("no GPU kernels" in n for n in empty.notes)
    as_cpu = read_trace(cpu)  # no GPU kernels: the CPU ops are analyzed by default
    assert any("CPU ops analyzed" in n for n in as_cpu.notes)
    rep = analyze(as_cpu).to_json()["devices"]["77"]
    assert rep["compute_busy_us"] == 15 and rep["phases"] == {"ub0": {"experts": 20.0}}
    assert kernel_ubatches(as_cpu) == [0, 0]
    # A trace with GPU kernels leaves its CPU ops out unless asked.
    mixed = write_chrome(tmp_path / "mixed.json", [kernel("gemm", 0, 10),
                                                   kernel("aten::mm", 0, 10, pid=77, tid=78, cat="cpu_op")])
    assert [k.name for k in read_trace(mixed).kernels] == ["gemm"]
    assert len(read_trace(mixed, config=ReadConfig(cpu_ops_as_kernels=True)).kernels) == 2


def test_cli_analyzes_a_cpu_trace_without_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = write_chrome(tmp_path / "cpu.json", [kernel("aten::mm", 0, 10, pid=77, tid=78, cat="cpu_op")])
    assert main([str(cpu)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["num_devices"] == 1
    assert "ReadConfig" not in out  # the CLI's words, not the library's


def test_cli_fails_on_a_trace_with_nothing_to_analyze(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bare = write_chrome(tmp_path / "bare.json", [cpu_label("step/0", 0, 10)])
    assert main([str(bare)]) == 1
    err = capsys.readouterr().err
    assert "nothing to analyze" in err and len(err.strip().splitlines()) == 1


def test_cpu_phase_time_leaves_out_time_the_ubatch_was_paused(tmp_path: Path) -> None:
    """ub0's dispatch_send stays open while ub1 runs (40..70): only 10 + 10 us are active."""
    dev = analyze(read_chrome_trace(write_chrome(tmp_path / "t.json", [
        kernel("aten::mm", 0, 100, pid=77, tid=78, cat="cpu_op"),
        cpu_label("ub0/run", 0, 40, tid=78), cpu_label("ub1/run", 40, 30, tid=78),
        cpu_label("ub0/run", 70, 30, tid=78),
        cpu_label("ub0/L1/dispatch_send", 30, 50, tid=78),
        cpu_label("ub1/L1/attention", 45, 20, tid=78),
    ]))).to_json()["devices"]["77"]
    assert dev["phases"]["ub0"]["dispatch_send"] == 20.0
    assert dev["phases"]["ub1"]["attention"] == 20.0
    assert (dev["phases"]["ub0"]["run"], dev["phases"]["ub1"]["run"]) == (70.0, 30.0)


def test_read_trace_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt.*unknown trace format"):
        read_trace(bad)
    rep = tmp_path / "run.nsys-rep"
    rep.write_bytes(b"\x00binary")
    with pytest.raises(ValueError, match="nsys export --type sqlite"):
        read_trace(rep)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        read_trace(broken)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_trace(tmp_path / "missing.json")


# ---------------------------------------------------------------- Nsight SQLite


BASE_NS = 1_000_000_000
PID = 5
GLOBAL_TID = (PID << 24) | 100
GLOBAL_PID = PID << 24

# One scenario, written both ways: (name, device, stream, start_us, dur_us, category, launch_us).
KERNELS = [
    ("gemm", 0, 7, 0, 50, "kernel", 0),
    ("gemm", 0, 7, 60, 40, "kernel", 55),
    ("ncclDevKernel_AllToAll", 0, 13, 40, 30, "kernel", 35),
    ("Memcpy PtoP", 0, 14, 65, 10, "memcpy", 58),
    ("gemm", 1, 7, 0, 30, "kernel", 1),
    ("ncclDevKernel_AllToAll", 1, 20, 20, 30, "kernel", 2),
]
CPU_LABELS = [("ub0/L0/attention", 0, 30), ("ub0/L0/dispatch_send", 30, 20),
              ("ub1/L0/attention", 50, 20), ("ub0/L0/dispatch_recv", 34, 40)]


def write_equivalent_chrome(path: Path) -> Path:
    events = []
    for corr, (name, dev, stream, start, dur, cat, launch) in enumerate(KERNELS, start=1):
        events.append(kernel(name, BASE_NS / 1000 + start, dur, pid=dev, tid=stream,
                             cat="kernel" if cat == "kernel" else "gpu_memcpy", correlation=corr))
        events.append(kernel("cudaLaunchKernel", BASE_NS / 1000 + launch, 1, pid=PID, tid=100,
                             cat="cuda_runtime", correlation=corr))
    events += [cpu_label(n, BASE_NS / 1000 + s, d) for n, s, d in CPU_LABELS]
    return write_chrome(path, events)


def write_nsys_sqlite(path: Path, *, with_nvtx: bool = True, with_runtime: bool = True) -> Path:
    """The table layout of 'nsys export --type sqlite' (the columns the reader uses, and some)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL,
            deviceId INT NOT NULL, contextId INT, streamId INT NOT NULL, correlationId INT,
            globalPid INT, demangledName INT, shortName INT, mangledName INT, gridX INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL,
            deviceId INT, contextId INT, streamId INT, correlationId INT, globalPid INT,
            bytes INT, copyKind INT, srcKind INT, dstKind INT);
    """)
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings) + 1
            db.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    if with_runtime:
        db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT NOT NULL, end INT NOT NULL, "
                   "eventClass INT, globalTid INT, correlationId INT, nameId INT, returnValue INT)")
    for corr, (name, dev, stream, start, dur, cat, launch) in enumerate(KERNELS, start=1):
        s, e = BASE_NS + start * 1000, BASE_NS + (start + dur) * 1000
        if cat == "kernel":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,1,?,?,?,?,?,?,1)",
                       (s, e, dev, stream, corr, GLOBAL_PID, sid(f"void {name}(int)"), sid(name),
                        sid("_Z" + name)))
        else:
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,1,?,?,?,4096,10,3,3)",
                       (s, e, dev, stream, corr, GLOBAL_PID))
        if with_runtime:
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,0,?,?,?,0)",
                       (BASE_NS + launch * 1000, BASE_NS + launch * 1000 + 1000, GLOBAL_TID, corr,
                        sid("cudaLaunchKernel_v7000")))
    if with_nvtx:
        db.execute("CREATE TABLE NVTX_EVENTS (start INT NOT NULL, end INT, eventType INT NOT NULL, "
                   "rangeId INT, category INT, color INT, text TEXT, globalTid INT, endGlobalTid INT, "
                   "textId INT, domainId INT)")
        for event_type, text in ((75, "dbo"), (34, "a mark")):  # domain create, mark: not ranges
            db.execute("INSERT INTO NVTX_EVENTS VALUES (?, NULL, ?, NULL, NULL, NULL, ?, ?, NULL, NULL, 1)",
                       (BASE_NS, event_type, text, GLOBAL_TID))
        for i, (name, start, dur) in enumerate(CPU_LABELS):
            # Registered strings come through textId; plain messages through text.
            text, text_id = (None, sid(name)) if i % 2 else (name, None)
            db.execute("INSERT INTO NVTX_EVENTS VALUES (?, ?, 60, ?, NULL, NULL, ?, ?, ?, ?, 1)",
                       (BASE_NS + start * 1000, BASE_NS + (start + dur) * 1000, i, text,
                        GLOBAL_TID, GLOBAL_TID, text_id))
    db.commit()
    db.close()
    return path


def _ubatch_rows(trace: Trace) -> list[tuple[int, int, float, int | None]]:
    owners = zip(trace.kernels, kernel_ubatches(trace), strict=True)
    return sorted((k.device, k.stream, k.start_us, ub) for k, ub in owners)


def test_nsys_sqlite_gives_the_same_answers_as_chrome(tmp_path: Path) -> None:
    chrome = read_trace(write_equivalent_chrome(tmp_path / "t.json"))
    nsys = read_trace(write_nsys_sqlite(tmp_path / "t.sqlite"))
    a, b = analyze(chrome).to_json(), analyze(nsys).to_json()
    # The gap before the last gemm (host 5 of 10 us) is named by the kernel: Nsight keeps
    # the demangled name.
    befores = [[g.pop("before") for g in r["devices"]["0"]["compute_idle"]["largest"]]
               for r in (a, b)]
    assert befores == [["gemm"], ["void gemm(int)"]]
    assert a["devices"] == b["devices"]
    assert a["devices"]["0"]["compute_idle"]["host_us"] == 5
    dev0 = a["devices"]["0"]
    assert (dev0["comm_us"], dev0["comm_overlapped_us"], dev0["comm_exposed_us"]) == (35, 25, 10)
    assert dev0["phase_source"] == "cpu"
    assert dev0["phases"] == {"ub0": {"attention": 30.0, "dispatch_recv": 40.0, "dispatch_send": 20.0},
                              "ub1": {"attention": 20.0}}
    assert _ubatch_rows(chrome) == _ubatch_rows(nsys)
    # Launch at 55 (inside ub1/attention, started after ub0/dispatch_recv) -> ub1; at 58 -> ub1.
    assert [ub for *_, ub in _ubatch_rows(nsys)] == [0, 1, 0, 1, 0, 0]
    assert any(k.name == "void gemm(int)" for k in nsys.kernels)  # demangled name via StringIds
    assert analyze(nsys).notes == []


def test_nsys_sqlite_without_optional_tables(tmp_path: Path) -> None:
    path = write_nsys_sqlite(tmp_path / "bare.sqlite", with_nvtx=False, with_runtime=False)
    trace = read_nsys_sqlite(path, config=ReadConfig(include_memcpy=False))
    assert trace.labels == [] and all(k.launch_us is None for k in trace.kernels)
    assert len(trace.kernels) == 5 and any("NVTX_EVENTS" in n for n in trace.notes)
    # Names stored as text (older exports) instead of StringIds ids.
    db = sqlite3.connect(tmp_path / "text.sqlite")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, "
               "streamId INT, shortName TEXT)")
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (0, 4000, 2, 9, 'ncclKernel')")
    db.commit()
    db.close()
    rep = analyze(read_trace(tmp_path / "text.sqlite")).to_json()
    assert rep["devices"]["2"]["comm_us"] == 4.0


# ---------------------------------------------------------------- CLI


def test_cli_prints_table_then_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_equivalent_chrome(tmp_path / "t.json")
    out_json, out_png = tmp_path / "out" / "report.json", tmp_path / "out" / "timeline.png"
    assert main([str(path), "--json", str(out_json), "--png", str(out_png),
                 "--comm-pattern", "gemm_not_really"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("exposed_us" in line for line in lines[:-1])  # the table header
    final = json.loads(lines[-1])
    assert final == json.loads(out_json.read_text())
    for key in ("wall_us", "compute_busy_us", "comm_us", "comm_overlapped_us", "comm_exposed_us",
                "overlap_fraction", "streams", "phases"):
        assert key in final["devices"]["0"]
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_comm_pattern_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_chrome(tmp_path / "t.json", [kernel("gemm", 0, 10), kernel("my_exchange", 0, 5, tid=9)])
    assert main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["devices"]["0"]["comm_us"] == 0
    assert main([str(path), "--comm-pattern", "my_exch", "--only-comm-patterns"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["devices"]["0"]["comm_us"] == 5
    assert main([str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_gpu_step_label_is_widened_by_kernels_the_step_launched(tmp_path: Path) -> None:
    """A DBO step queues its kernels from the ubatches' greenlets: the profiler gives
    the step's GPU label only the first kernels; the window still spans the step."""
    dev = one_device(tmp_path, [
        cpu_label("step/0", 50, 100),                                          # CPU [50, 150)
        gpu_label("step/0", 100, 5),                                           # GPU [100, 105)
        kernel("cudaLaunchKernel", 60, 2, pid=4242, tid=100, cat="cuda_runtime", correlation=1),
        kernel("cudaLaunchKernel", 90, 2, pid=4242, tid=100, cat="cuda_runtime", correlation=2),
        kernel("gemm", 100, 5, correlation=1),
        kernel("gemm", 120, 60, correlation=2),   # queued inside a ubatch: GPU [120, 180)
        kernel("gemm", 300, 10),                  # a later step's: outside
    ])
    assert dev["window_source"] == "gpu step labels" and dev["wall_us"] == 80  # [100, 180)
    assert dev["compute_busy_us"] == 65


# ------------------------------------------------------------------ compute-stream idle


def launch(ts: float, correlation: int) -> dict[str, Any]:
    """A cudaLaunchKernel call linked to the kernel with the same correlation id."""
    return kernel("cudaLaunchKernel", ts, 2, pid=4242, tid=100, cat="cuda_runtime",
                  correlation=correlation)


def test_compute_idle_splits_host_and_held_back_gaps(tmp_path: Path) -> None:
    """Compute [0,10) [30,40) [50,60) on stream 7, comm [10,50) on stream 9, window [-5, 65).
    The second kernel was launched at 25, after the first ended at 10: 15 of its 20-us gap
    waited for the host. The third was launched at 5, long before: its 10-us gap was held
    back (here by the transfer it follows)."""
    dev = one_device(tmp_path, [
        gpu_label("ProfilerStep#1", -5, 70),
        kernel("gemm_a", 0, 10, correlation=1), launch(-1, 1),
        kernel("gemm_b", 30, 10, correlation=2), launch(25, 2),
        kernel("sum_rows", 50, 10, correlation=3), launch(5, 3),
        kernel("ncclDevKernel_SendRecv", 10, 40, tid=9),
        gpu_label("ub0/L0/experts", 30, 15), gpu_label("ub1/L0/combine_recv", 50, 10),
        gpu_label("ub1/run", 0, 60),
    ])
    idle = dev["compute_idle"]
    assert idle["stream"] == 7 and dev["wall_us"] == 70
    assert idle["idle_us"] == 40 and idle["num_gaps"] == 2
    assert (idle["host_us"], idle["wait_us"], idle["edges_us"]) == (15, 15, 10)
    assert [(g["offset_us"], g["length_us"], g["host_us"], g["before"]) for g in idle["largest"]] \
        == [(15, 20, 15, "ub0/L0/experts"), (45, 10, 0, "ub1/L0/combine_recv")]


def test_compute_idle_without_launch_links_or_compute(tmp_path: Path) -> None:
    """No linked launches: every gap counts as held back, named by the next kernel; a
    device with comm only has no compute stream to report."""
    dev = one_device(tmp_path, [kernel("gemm_a", 0, 10), kernel("gemm_b", 25, 5),
                                kernel("gemm_c", 28, 10)])  # overlaps gemm_b: one busy span
    idle = dev["compute_idle"]
    assert (idle["idle_us"], idle["host_us"], idle["wait_us"], idle["num_gaps"]) == (15, 0, 15, 1)
    assert idle["largest"][0]["before"] == "gemm_b"
    comm_only = one_device(tmp_path, [kernel("ncclDevKernel_SendRecv", 0, 10)])
    assert comm_only["compute_idle"] is None


def test_compute_idle_in_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_chrome(tmp_path / "t.json", [kernel("gemm", 0, 10, correlation=1), launch(-3, 1),
                                              kernel("gemm", 40, 10, correlation=2), launch(30, 2)])
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "compute stream 7 idle 30.0 us" in out and "waiting for the host 20.0" in out
    assert "gap      30.0 us at +10.0 (host 20.0) before gemm" in out


def test_cpu_labels_of_several_processes_go_to_the_device_each_launched_on() -> None:
    """One Nsight report of a `torchrun` launcher holds every rank: each rank's CPU-side
    ranges describe its own GPU only (matched through the threads that launched kernels)."""
    from traces.model import Label

    def k(device: int, tid: int, start: float) -> KernelInterval:
        return KernelInterval(device=device, stream=7, name="gemm", start_us=start,
                              end_us=start + 10, category="kernel", launch_us=start - 1,
                              launch_tid=tid)

    kernels = [k(0, 100, 10), k(0, 100, 30), k(1, 200, 10), k(1, 200, 30)]
    labels = [Label.from_name("step/0", start_us=0, end_us=50, device=None, tid=100),
              Label.from_name("step/0", start_us=0, end_us=50, device=None, tid=200),
              Label.from_name("ub0/L0/experts", start_us=5, end_us=9, device=None, tid=100),
              Label.from_name("ub0/L0/experts", start_us=5, end_us=25, device=None, tid=200)]
    report = analyze(Trace(kernels=kernels, labels=labels, source="two ranks")).to_json()
    phases = {d: report["devices"][d]["phases"]["ub0"]["experts"] for d in ("0", "1")}
    assert phases == {"0": pytest.approx(4.0), "1": pytest.approx(20.0)}
    # Launch threads unknown: every CPU-side label still counts for every device.
    unknown = [KernelInterval(device=0, stream=7, name="gemm", start_us=10, end_us=20,
                              category="kernel")]
    report = analyze(Trace(kernels=unknown, labels=labels[2:], source="no launches")).to_json()
    assert report["devices"]["0"]["phases"]["ub0"]["experts"] == pytest.approx(20.0)
