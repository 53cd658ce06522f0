"""Enqueue throughput against the number of producers: 1, 2, 4 and 8 threads sharing one app
(a threaded web server), and as many processes with an app each (a forking one), for plain
Celery, taskdedup and the peers, on a RabbitMQ broker and on a Redis broker (fused). Every
call has arguments of its own, so each one publishes. Drawn to docs/bench-throughput.png.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from typing import Any

from benchmarks.celery_publish import AMQP_URL, LIBRARIES, _answers, _clean
from benchmarks.common import ROOT

COUNTS = (1, 2, 4, 8)
LAYOUTS = {"RabbitMQ broker, Redis store": "amqp", "Redis broker, store fused": "redis"}
PLOT = ROOT / "docs" / "bench-throughput.png"


def _calls(send: Any, seconds: float, base: int) -> int:
    done, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        send((base + done,))
        done += 1
    return done


def _threads(send: Any, count: int, seconds: float) -> float:
    counts = [0] * count

    def one(i: int) -> None:
        counts[i] = _calls(send, seconds, (i + 1) * 10_000_000 + uuid.uuid4().int % 1_000_000)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(counts) / seconds


def _in_process(name: str, url: str, prefix: str, broker: str, seconds: float, out: Any) -> None:
    send = LIBRARIES[name](url, prefix, broker)
    send((-1,))  # connections made before the clock starts
    out.put(_calls(send, seconds, uuid.uuid4().int % 1_000_000_000))


def _processes(name: str, url: str, prefix: str, broker: str, count: int, seconds: float) -> float:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_in_process, args=(name, url, prefix, broker, seconds, out))
        for _ in range(count)
    ]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def run(url: str, seconds: float = 1.5) -> dict[str, Any]:
    """{layout: {mode: {library: [calls/s for each count]}}}, and the plot drawn."""
    found: dict[str, Any] = {}
    for layout, kind in LAYOUTS.items():
        broker = AMQP_URL if kind == "amqp" else url
        if kind == "amqp" and not _answers(broker):
            continue
        prefixes = {name: "tdbench-" + uuid.uuid4().hex[:8] for name in LIBRARIES}
        try:
            modes: dict[str, dict[str, list[float]]] = {"threads": {}, "processes": {}}
            for name in LIBRARIES:
                send = LIBRARIES[name](url, prefixes[name], broker)
                send((-1,))
                modes["threads"][name] = [_threads(send, n, seconds) for n in COUNTS]
                modes["processes"][name] = [
                    _processes(name, url, prefixes[name], broker, n, seconds) for n in COUNTS
                ]
            found[layout] = modes
        finally:
            _clean(url, broker, prefixes.values())
    draw(found)
    return found


def draw(found: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(found), 2, figsize=(11, 4 * len(found)), squeeze=False)
    for row, (layout, modes) in enumerate(found.items()):
        for col, (mode, libraries) in enumerate(modes.items()):
            ax = axes[row][col]
            for name, values in libraries.items():
                ax.plot(COUNTS, values, marker="o", label=name)
            ax.set_title(f"{layout}: producer {mode}")
            ax.set_xlabel(f"producer {mode}")
            ax.set_ylabel("enqueues per second (unique arguments)")
            ax.set_xticks(COUNTS)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(exist_ok=True)
    fig.savefig(PLOT, dpi=90)
    plt.close(fig)
