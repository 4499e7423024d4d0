"""The CUDA graph stand-in for CPU tests (issue 38; since issue 62 it lives in the engine as
`infer.engine.graphs.GraphStandIn`, so that gpu_check's dry run takes the same start-up path).

`install(engine)` swaps it into a built engine (its graphs then captured lazily, at first use);
`infer.engine.graphs.use_stand_in()` makes engines built inside it capture through it at start-up,
as a CUDA engine does."""
from __future__ import annotations

import weakref

from infer.engine.graphs import GraphStandIn as ReplayGraphs, use_stand_in  # noqa: F401 (re-exported)


def install(engine) -> ReplayGraphs:
    """Run `engine`'s decode stages through graph replay (its runner must be a ModelRunner)."""
    r = engine.runner
    r.graphs = ReplayGraphs(weakref.proxy(r))
    r.batch_state.bucketed = True
    return r.graphs
