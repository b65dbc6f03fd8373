"""The serving engine for one model: requests in, one step at a time, outputs out.

    Engine.step:  plan = scheduler.schedule()                  engine/scheduler.py
                  out  = runner.run(plan)                      engine/runner.py (one jitted call)
                  scheduler.update_from_output(plan, out)      the only place results land

See docs/architecture.md for every module of this package and who owns which fact.
"""

from paged_jax.engine.config import EngineConfig
from paged_jax.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
