"""Triton device code: programmatic dependent launch (Hopper+), shared by the launches that use it.

A kernel launched with PDL (runtime/launch.py ``pdl_ok``) may begin while the previous kernel in
the stream is still running; it waits on griddepcontrol before touching memory, then lets its own
dependent launch begin, so consecutive launches overlap their launch latency instead of
following each other.
"""

import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream (all its writes visible), then let the next
    one launch early (it waits likewise). A no-op unless launched with launch_pdl."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
