"""The aten ops a call dispatches at the top level (torch.profiler), for the
tests that pin a torch path's op sequence against MHA's."""

from __future__ import annotations

from typing import Any


def top_level_aten_ops(fn: Any) -> list[str]:
    """The aten ops ``fn()`` calls at the top level, in order (the ops an aten
    op runs inside itself are not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(
        (e for e in prof.events() if e.name.startswith("aten::")),
        key=lambda e: (e.time_range.start, -e.time_range.end),
    )
    names, end = [], -1
    for e in events:
        if e.time_range.start >= end:  # not inside the previous top-level op
            names.append(e.name)
            end = e.time_range.end
    return names
