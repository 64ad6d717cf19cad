"""Data parallelism, from the plain to the fast: :mod:`.naive` (allreduce each gradient after the
backward; the reading twin), :mod:`.bucketed` (gradient buckets reduced as the backward fills
them, overlapped; the loss factors and shards of heterogeneous replicas), :mod:`.hetero`
(speed-weighted shares, the balancer and the emulated slowdown; Moreno-Álvarez et al. 2022)."""
