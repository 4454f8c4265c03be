"""What a run tells about itself while it runs: metrics to JSONL, TensorBoard and the console
(`metrics`), where the wall time goes (`goodput`), profiler traces (`profiling`), model FLOPs
utilization (`flops`), and the stuck-step watchdog (`watchdog`). Import the modules themselves;
this package re-exports nothing."""
