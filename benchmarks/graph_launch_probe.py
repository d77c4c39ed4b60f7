"""Host cost of ``CUDAGraph.replay`` and whether re-launching a graph that still runs blocks the host.

    python3 benchmarks/graph_launch_probe.py

Captures graphs of 20, 140 and 600 tiny elementwise kernels and launches one 50 times back to back ("same") or two
copies in turn ("alternate"), printing the host time per launch (median, and the loop's mean) and the time per
launch once the device has drained (the graph's own device time).
"""

import time

import torch


def capture(x: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    def body() -> torch.Tensor:
        y = x
        for _ in range(n):
            y = y * 1.0001 + 0.5  # two kernels
        return y
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def main() -> None:
    x = torch.zeros(256, device="cuda")
    reps = 50
    for n in (10, 70, 300):
        graphs = [capture(x, n) for _ in range(2)]
        for mode in ("same", "alternate"):
            for g in graphs:
                g.replay()
            torch.cuda.synchronize()
            host = []
            start = time.perf_counter()
            for i in range(reps):
                g = graphs[0] if mode == "same" else graphs[i % 2]
                t = time.perf_counter()
                g.replay()
                host.append(time.perf_counter() - t)
            loop = time.perf_counter()
            torch.cuda.synchronize()
            end = time.perf_counter()
            print(f"kernels {2 * n:4d} {mode:9s}: host per launch median {1e6 * sorted(host)[reps // 2]:7.1f} us, "
                  f"loop {1e6 * (loop - start) / reps:7.1f} us, "
                  f"with the device drained {1e6 * (end - start) / reps:7.1f} us per launch")


if __name__ == "__main__":
    main()
