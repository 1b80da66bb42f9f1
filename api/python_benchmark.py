"""Predictions per second through the Python module, from one thread and from several.

    ./bazelw run //api:python_benchmark

Each prediction is llama-3-8b (every default variant) at one point of a batch x seq grid;
then the study's sizes through predict() one by one and through one predict_many() call.
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import memledger  # noqa: E402


def grid():
    return [(b, s) for b in (1, 2, 4, 8, 16, 32, 64) for s in (1024, 2048, 4096, 8192, 16384, 32768)]


def run(points, repeat):
    for _ in range(repeat):
        for batch, seq in points:
            memledger.predict(model="llama-3-8b", batch=batch, seq=seq, amp="bf16")


def main():
    points = grid()
    repeat = 20
    start = time.perf_counter()
    run(points, repeat)
    one = len(points) * repeat / (time.perf_counter() - start)
    threads = [threading.Thread(target=run, args=(points, repeat)) for _ in range(4)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    four = 4 * len(points) * repeat / (time.perf_counter() - start)
    print(f"{memledger.__version__}")
    print(f"llama-3-8b, predict(): 1 thread: {one:,.0f} predictions/s; 4 threads: "
          f"{four:,.0f} predictions/s ({os.cpu_count()} cores)")
    study()


def study():
    """The study's sizes over a batch x seq grid, the four variants' saved bytes: single
    predict() calls (JSON both ways, peaks on, as a caller sweeps today) against one
    predict_many() call, without and with peaks. The batch's 12,800 requests are all
    different points, so nothing a request computed can be its answer to another."""
    requests = [dict(batch=b, seq=s) for b in range(1, 65) for s in (16, 32, 64, 128, 256)]
    start = time.perf_counter()
    for r in requests:
        memledger.predict(**r)
    single = len(requests) / (time.perf_counter() - start)
    many_requests = [dict(batch=b, seq=8 * s) for b in range(1, 65) for s in range(1, 201)]
    rates = []
    for _ in range(5):  # the median of five calls
        start = time.perf_counter()
        memledger.predict_many(many_requests, peak=False)
        rates.append(len(many_requests) / (time.perf_counter() - start))
    buckets = sorted(rates)[2]
    start = time.perf_counter()
    memledger.predict_many(requests, peak=True)
    peaks = len(requests) / (time.perf_counter() - start)
    print(f"study, predict() one by one: {single:,.0f}/s; predict_many(peak=False): "
          f"{buckets:,.0f}/s ({buckets / single:.1f}x); predict_many(peak=True): "
          f"{peaks:,.0f}/s ({peaks / single:.1f}x)")


if __name__ == "__main__":
    main()
