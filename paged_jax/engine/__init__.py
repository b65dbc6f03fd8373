"""The serving engine for one model: requests in, one step at a time, outputs out.

    Engine.step:  plan = scheduler.schedule()                  engine/scheduler.py
                  p = runner.dispatch(plan)                    engine/runner.py (one jitted call)
                  scheduler.sent(plan)                         its tokens count as computed
                  out = runner.collect(p)                      the one device -> host read
                  scheduler.update_from_output(plan, out)      the only place results land

With async scheduling the collect happens one step later (engine/engine.py).

See docs/architecture.md for every module of this package and who owns which fact.
"""

from paged_jax.engine.config import EngineConfig
from paged_jax.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]
