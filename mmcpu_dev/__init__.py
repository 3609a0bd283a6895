"""Dev tooling: tests, benchmarks, smoke checks, Kubernetes checks and fixture builders. The runtime image does not
import it (see the package map in README.md)."""
