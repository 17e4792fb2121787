"""SLICE (SLO-driven scheduling, Zhou et al.) as a vLLM V1 scheduler plugin.

Enable with `vllm serve ... --scheduler-cls laneway_slice.scheduler.SliceScheduler`
(docs/slice.md). Importing this package does not import vLLM: the pure math
(`slice_math`), the request classes (`slo_classes`), the step-latency profile
(`latency_profile`) and the planner (`planner`) are usable and testable without it.
"""
