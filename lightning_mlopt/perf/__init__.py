"""The numbers behind PerformanceMonitor and ``profile``: step-time breakdown, FLOPs, peaks, memory, traces."""
