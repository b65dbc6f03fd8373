"""`make run`: the headline experiment (placeholder until the experiments issue lands).

For now it runs the allocator benchmark: allocate / free / fork for 256 sequences inside one
jitted loop against a Python free list, and saves results/bench_allocator.json.
"""

from experiments import bench_allocator

if __name__ == "__main__":
    bench_allocator.main()
