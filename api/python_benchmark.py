"""Predictions per second through the Python module, from one thread and from several.

    ./bazelw run //api:python_benchmark

Each prediction is llama-3-8b (every default variant) at one point of a batch x seq grid.
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
    print(f"1 thread: {one:,.0f} predictions/s; 4 threads: {four:,.0f} predictions/s "
          f"({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
