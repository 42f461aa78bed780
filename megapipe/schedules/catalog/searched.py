"""``auto``: the schedule the search (``schedules/analysis/schedule_search.py``) makes for a run's stage
costs. It has no generator here and no closed form: the search runs it on the simulator, within
1F1B's memory by default, over the looped placement with split backwards. Its bubble for equal
ranks is at most ZB-H1's (p - 1 chunks' forwards), a seed of the search."""

from __future__ import annotations

from megapipe.schedules.catalog.descriptor import ScheduleDescriptor, Sizes, search_marker, zero_bubble_bubble

DESCRIPTOR = ScheduleDescriptor(
    "auto", None, "searched for the ranks' stage costs (--schedule-* flags, a profile, or else the stages' FLOPs)",
    sizes=Sizes(most_chunks=None), split_backward=True, costs=search_marker(zero_bubble_bubble))
