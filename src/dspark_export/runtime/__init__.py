"""The speculative loop, its policies, continuous batching and the embedding front end (docs/ARCHITECTURE.md)."""

#: what `generate` and `serve` run unless told (`runtime.policies`): the best policy measured on the default
#: engines; it prices the drafter and skips it where drafting does not pay (reports/peers/v12/select:
#: dspark-async 1.01 × ar, dspark 0.87 ×, fixed:1 0.83 ×). Here so the CLI reads it without importing numpy.
DEFAULT_POLICY = "dspark-async"
