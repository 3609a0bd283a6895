"""Dev tooling: tests' servers, benchmarks, smoke checks, Kubernetes checks and fixture builders, apart from the
runtime package: neither the mmcpu wheel nor the runtime image holds it (see the layout table in README.md)."""
